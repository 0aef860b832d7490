"""scripts/mutation_check.py's table stays true of the code: every listed mutation still applies to today's source
(its text occurs as often as stated, the mutant compiles, its tests exist) and every covered file keeps its minimum
number of mutations; and the check notices when that stops being so. Reads files only (no mutant is run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("mutation_check", None)


def test_every_mutation_applies_to_todays_source_and_names_existing_tests(script, capsys):
    assert script.check() == []
    assert script.main(["--check"]) == 0
    assert "mutations apply to the source" in capsys.readouterr().out


def test_every_covered_file_has_at_least_five_mutations(script):
    for target in (
        "fedrec_flwr/unlearning/krylov.py",
        "fedrec_flwr/unlearning/influence.py",
        "strategies/unlearning*.py",
        "fedrec_flwr/unlearning/margin.py",
        "fedrec_flwr/adversary/",
        "strategies/adversary.py",
        "fedrec_flwr/data/split.py",
        "fedrec_flwr/attacks/",
        "fedrec_flwr/state/checkpoint.py",
        "fedrec_flwr/state/client_state.py",
        "strategies/server_optimizer.py",
        "clients/pfedrec.py",
    ):
        assert script.COVERAGE[target] >= 5
        assert sum(script._covers(target, m.path) for m in script.MUTATIONS) >= 5, target


def test_the_check_reports_a_stale_mutation_a_missing_test_and_thin_coverage(script, tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("a = 1\nb = a + 1\n")
    (tmp_path / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    one = script.one
    good = script.Mutation("good", "pkg/a.py", (one("b = a + 1", "b = a - 1"),), ("tests/test_a.py::test_a",))
    monkeypatch.setattr(script, "MUTATIONS", (good,))
    monkeypatch.setattr(script, "COVERAGE", {"pkg/a.py": 1})
    assert script.check(tmp_path) == []

    stale = script.Mutation("stale", "pkg/a.py", (one("a = 2", "a = 3"),), ("tests/test_a.py",))
    broken = script.Mutation("broken", "pkg/a.py", (one("b = a + 1", "b = (a"),), ("tests/test_a.py",))
    missing = script.Mutation(
        "missing", "pkg/a.py", (one("a = 1", "a = 0"),), ("tests/test_a.py::test_b", "tests/test_gone.py")
    )
    twice = script.Mutation("good", "pkg/a.py", (one("a", "c", 1),), ("tests/test_a.py",))
    monkeypatch.setattr(script, "MUTATIONS", (good, stale, broken, missing, twice))
    monkeypatch.setattr(script, "COVERAGE", {"pkg/a.py": 1, "pkg/other/": 2})
    problems = "\n".join(script.check(tmp_path))
    assert "stale: 'a = 2' occurs 0 times" in problems
    assert "broken: the mutated pkg/a.py does not compile" in problems
    assert "missing: tests/test_a.py has no test function 'test_b'" in problems
    assert "missing: test file tests/test_gone.py does not exist" in problems
    assert "duplicate mutation ids: ['good']" in problems and "good: 'a' occurs 2 times" in problems
    assert "pkg/other/: 0 mutations, at least 2 required" in problems
    assert script.main(["--check"]) == 1  # today's root with the fake table: the fake files are not there
