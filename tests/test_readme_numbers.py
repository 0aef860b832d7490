"""The README's quickstart figures are checked against a fresh run by scripts/check_readme_numbers.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT

SCRIPT = PROJECT_ROOT / "scripts" / "check_readme_numbers.py"


def _script():
    spec = importlib.util.spec_from_file_location("check_readme_numbers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quoted_figures_are_compared_at_the_readme_precision():
    check = _script()
    readme = ("```\nround    9 | HR@10    -   | NDCG@10    -   | train loss 0.3673 | 3.9 s\n"
              "round   10 | HR@10 0.3807 | NDCG@10 0.1967 | train loss 0.3764 | 14.9 s\n```\n")
    quotes = check.quoted(readme)
    assert quotes == {9: {"HR@10": "-", "NDCG@10": "-", "train-loss": "0.3673"},
                      10: {"HR@10": "0.3807", "NDCG@10": "0.1967", "train-loss": "0.3764"}}
    rows = [{"round": 9, "train-loss": 0.36731}, {"round": 10, "HR@10": 0.38070, "NDCG@10": 0.19674,
                                                  "train-loss": 0.37644}]
    assert check.compare(quotes, rows) == []
    rows[1]["HR@10"] = 0.3796
    assert check.compare(quotes, rows) == ["round 10 HR@10: README 0.3807, fresh run 0.3796"]
    assert check.compare({10: {"HR@10": "0.381"}}, rows) == ["round 10 HR@10: README 0.381, fresh run 0.380"]


def test_the_readme_quotes_quickstart_figures():
    quotes = _script().quoted((PROJECT_ROOT / "README.md").read_text())
    assert 10 in quotes and quotes[10]["HR@10"] != "-"


@pytest.mark.slow  # 70 s of MovieLens-100K training in process (10 rounds, 943 users)
def test_readme_quickstart_figures_match_a_fresh_10_round_run(ml100k_dir, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "10", "--results-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "FEDREC_DATA_DIR": str(ml100k_dir.parent)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
