"""experiments/quickstart.sh passes the user's run-config overrides through to the launcher; its own default
(results under ./results) gives way to a results-dir the user names (it was refused as "given twice")."""

from __future__ import annotations

import os
import shutil
import subprocess

from conftest import PROJECT_ROOT


def _launcher_args(tmp_path, *args: str) -> list[str]:
    """Run a copy of quickstart.sh whose .venv/bin/python only prints its arguments, one per line."""
    (tmp_path / "experiments").mkdir(parents=True)
    shutil.copy(PROJECT_ROOT / "experiments" / "quickstart.sh", tmp_path / "experiments" / "quickstart.sh")
    (tmp_path / "pyproject.toml").write_text("")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    python.chmod(0o755)
    (tmp_path / ".venv" / ".fedrec-installed").touch()  # installed: newer than pyproject.toml
    os.utime(tmp_path / "pyproject.toml", (1, 1))
    out = subprocess.run(
        ["bash", str(tmp_path / "experiments" / "quickstart.sh"), *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "FEDREC_DATA_DIR": str(tmp_path)},
    )
    return out.stdout.splitlines()


def test_quickstart_writes_under_results_unless_a_results_dir_is_given(tmp_path):
    args = _launcher_args(tmp_path / "a", "num-server-rounds=1")
    assert args == ["-m", "fedrec_flwr.launch", "run", f"results-dir={tmp_path / 'a'}/results", "num-server-rounds=1"]
    args = _launcher_args(tmp_path / "b", "results-dir=/tmp/elsewhere", "num-server-rounds=1")
    assert args == ["-m", "fedrec_flwr.launch", "run", "results-dir=/tmp/elsewhere", "num-server-rounds=1"]
    assert _launcher_args(tmp_path / "c") == [
        "-m",
        "fedrec_flwr.launch",
        "run",
        f"results-dir={tmp_path / 'c'}/results",
    ]
