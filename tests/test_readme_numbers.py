"""The README's quickstart figures are checked against a fresh run by scripts/check_readme_numbers.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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
    readme = (
        "```\nround    9 | HR@10    -   | NDCG@10    -   | train loss 0.3673 | 3.9 s\n"
        "round   10 | HR@10 0.3807 | NDCG@10 0.1967 | train loss 0.3764 | 14.9 s\n```\n"
    )
    quotes = check.quoted(readme)
    assert quotes == {
        9: {"HR@10": "-", "NDCG@10": "-", "train-loss": "0.3673"},
        10: {"HR@10": "0.3807", "NDCG@10": "0.1967", "train-loss": "0.3764"},
    }
    rows = [
        {"round": 9, "train-loss": 0.36731},
        {"round": 10, "HR@10": 0.38070, "NDCG@10": 0.19674, "train-loss": 0.37644},
    ]
    assert check.compare(quotes, rows) == []
    rows[1]["HR@10"] = 0.3796
    assert check.compare(quotes, rows) == ["round 10 HR@10: README 0.3807, fresh run 0.3796"]
    assert check.compare({10: {"HR@10": "0.381"}}, rows) == ["round 10 HR@10: README 0.381, fresh run 0.380"]


def test_the_readme_quotes_quickstart_figures():
    quotes = _script().quoted((PROJECT_ROOT / "README.md").read_text())
    assert 10 in quotes and quotes[10]["HR@10"] != "-"


@pytest.mark.slow  # 70 s of MovieLens-100K training in process (10 rounds, 943 users)
def test_readme_quickstart_figures_match_a_fresh_10_round_run(ml100k_dir, tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "10", "--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "FEDREC_DATA_DIR": str(ml100k_dir.parent)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _fake_run(monkeypatch, hr10: float):
    """Replace the 10-round training by a run that writes one metrics row (round 10, HR@10 ``hr10``)."""
    import json

    import fedrec_flwr.serial

    def fake_run_serial(config):
        folder = Path(config.results_dir) / config.run_name
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(
            json.dumps([{"round": 10, "HR@10": hr10, "NDCG@10": 0.1967, "train-loss": 0.3764}])
        )
        return folder

    monkeypatch.setattr(fedrec_flwr.serial, "run_serial", fake_run_serial)


README_ROUND_10 = "round   10 | HR@10 0.3807 | NDCG@10 0.1967 | train loss 0.3764 | 14.9 s\n"


def _check_in_temp(monkeypatch, tmp_path, fresh_hr10: float) -> int:
    """The script on a one-line README (HR@10 0.3807 at round 10) against a fake run giving ``fresh_hr10``, with its
    temp folder under ``tmp_path``; returns its exit code."""
    _fake_run(monkeypatch, fresh_hr10)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    readme = tmp_path / "README.md"
    readme.write_text(README_ROUND_10)
    return _script().main(["--rounds", "10", "--readme", str(readme)])


def test_readme_check_removes_its_temp_folder_when_every_figure_matches(monkeypatch, tmp_path, capsys):
    assert _check_in_temp(monkeypatch, tmp_path, 0.3807) == 0
    assert list(tmp_path.glob("readme-check-*")) == []
    assert "all match" in capsys.readouterr().out


def test_readme_check_keeps_its_temp_folder_and_prints_it_when_a_figure_differs(monkeypatch, tmp_path, capsys):
    assert _check_in_temp(monkeypatch, tmp_path, 0.3796) == 1
    kept = list(tmp_path.glob("readme-check-*"))
    assert len(kept) == 1
    out = capsys.readouterr().out
    assert "round 10 HR@10: README 0.3807, fresh run 0.3796" in out
    assert f"results kept in {kept[0]}" in out


def test_readme_check_leaves_a_given_results_dir_alone(monkeypatch, tmp_path):
    _fake_run(monkeypatch, 0.3807)
    readme = tmp_path / "README.md"
    readme.write_text(README_ROUND_10)
    results = tmp_path / "results"
    assert _script().main(["--rounds", "10", "--readme", str(readme), "--results-dir", str(results)]) == 0
    assert (results / "readme-check" / "metrics.json").is_file()


def test_figures_are_compared_within_the_stated_spread_off_the_recording_machine():
    check = _script()
    quotes = {100: {"HR@10": "0.4751", "NDCG@10": "0.2671"}}
    other_cpu = [{"round": 100, "HR@10": 0.4740, "NDCG@10": 0.2664}]  # an AVX-512 machine's figures
    assert check.compare(quotes, other_cpu) == [
        "round 100 HR@10: README 0.4751, fresh run 0.4740",
        "round 100 NDCG@10: README 0.2671, fresh run 0.2664",
    ]
    assert check.compare(quotes, other_cpu, tolerance=0.002) == []
    far = [{"round": 100, "HR@10": 0.4720, "NDCG@10": 0.2671}]
    assert check.compare(quotes, far, tolerance=0.002) == ["round 100 HR@10: README 0.4751, fresh run 0.4720"]


def test_the_readme_states_the_spread_it_is_checked_with():
    readme = (PROJECT_ROOT / "README.md").read_text()
    assert _script().stated_tolerance(readme) == 0.002
    assert "0.4740 / 0.2664" in readme  # the other machine's figures, quoted beside the spread


README_WITH_SPREAD = README_ROUND_10 + "Expect the figures within **±0.002** on another CPU.\n"


def _check_with_machine(monkeypatch, tmp_path, recorded: dict | None, fresh_hr10: float) -> int:
    _fake_run(monkeypatch, fresh_hr10)
    tmp_path.mkdir(parents=True, exist_ok=True)
    readme = tmp_path / "README.md"
    readme.write_text(README_WITH_SPREAD)
    machine_file = tmp_path / "machine.json"
    if recorded is not None:
        import json

        machine_file.write_text(json.dumps(recorded))
    return _script().main(
        [
            "--rounds",
            "10",
            "--readme",
            str(readme),
            "--results-dir",
            str(tmp_path / "r"),
            "--machine-file",
            str(machine_file),
        ]
    )


def test_the_check_is_exact_on_the_recording_machine_and_says_so(monkeypatch, tmp_path, capsys):
    here = _script().machine()
    assert _check_with_machine(monkeypatch, tmp_path, here, 0.3796) == 1
    out = capsys.readouterr().out
    assert "comparing exactly: this is the machine that wrote the figures" in out
    assert "round 10 HR@10: README 0.3807, fresh run 0.3796" in out


def test_the_check_uses_the_stated_spread_on_another_machine_and_says_so(monkeypatch, tmp_path, capsys):
    other = {**_script().machine(), "cpu": "Another CPU", "cpu-capability": "AVX2"}
    assert _check_with_machine(monkeypatch, tmp_path, other, 0.3796) == 0
    out = capsys.readouterr().out
    assert "is not the one that wrote the figures (Another CPU, AVX2" in out
    assert "comparing within ±0.002" in out and "all match (within ±0.002)" in out
    assert _check_with_machine(monkeypatch, tmp_path / "b", other, 0.3780) == 1
