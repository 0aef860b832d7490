"""Every number the package computes stays what it was: short runs of every client family, the block and per-user
paths, unlearning, FedAU² and a Flower strategy, against digests recorded before the package's layout changed
(``tests/pinned/digests.py``).

On the machine that recorded them (same CPU model and vector ISA, torch and numpy), the final arrays and metrics must
match bit for bit. Elsewhere float32 kernels may round differently, so the test compares the recorded float64
summaries instead: array sums and sums of squares within a relative 1e-3, and every metric within 1e-3 relative (a
hit-rate within one user's share, 1/24, for a ranking tie that rounds the other way), and says which comparison ran.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
from conftest import PROJECT_ROOT

_SPEC = importlib.util.spec_from_file_location("pinned_digests", PROJECT_ROOT / "tests" / "pinned" / "digests.py")
pinned = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(pinned)
RECORDED = json.loads(pinned.DIGESTS.read_text())
SAME_MACHINE = pinned.machine() == RECORDED["machine"]


def test_every_case_is_recorded():
    assert set(RECORDED["cases"]) == set(pinned.CASES)
    for name, case in RECORDED["cases"].items():
        assert case["overrides"] == pinned.CASES[name], name


@pytest.mark.parametrize("name", sorted(pinned.CASES))
def test_short_run_reproduces_its_pinned_digest(name, tmp_path):
    recorded = RECORDED["cases"][name]
    fresh = pinned.digest(pinned.run_case(name, tmp_path))
    if SAME_MACHINE:
        assert fresh["arrays"] == recorded["arrays"], f"{name}: final_arrays.npz differs from its pinned digest"
        assert fresh["metrics"] == recorded["metrics"], f"{name}: metrics.json differs from its pinned digest"
        return
    print(f"{name}: another machine than the recording's ({RECORDED['machine']['cpu']}): comparing within tolerance")
    assert fresh["array-summary"].keys() == recorded["array-summary"].keys()
    for key, values in recorded["array-summary"].items():
        for got, want in zip(fresh["array-summary"][key], values):
            assert math.isclose(got, want, rel_tol=1e-3, abs_tol=1e-6), (name, key, got, want)
    assert len(fresh["metrics-rows"]) == len(recorded["metrics-rows"])
    for got_row, want_row in zip(fresh["metrics-rows"], recorded["metrics-rows"]):
        assert got_row.keys() == want_row.keys(), name
        for key, want in want_row.items():
            got = got_row[key]
            if isinstance(want, (int, float)) and not isinstance(want, bool):
                tol = 1 / 24 + 1e-9 if key.startswith(("HR@", "NDCG@", "val-")) else 0.0
                assert math.isclose(got, want, rel_tol=1e-3, abs_tol=max(tol, 1e-6)), (name, key, got, want)
            else:
                assert got == want, (name, key)
