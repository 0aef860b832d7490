"""The ``fedrec`` command: version, help, the config reference, ``--run-config`` files, refusals before anything
starts, the progress display (live bar on a terminal, plain lines elsewhere), and one real one-round run."""

from __future__ import annotations

import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version

import pytest
from conftest import write_tiny_dataset

from fedrec_flwr import cli, launch
from fedrec_flwr.app.message_window import send_and_receive
from fedrec_flwr.config import default_mapping
from fedrec_flwr.launch import PROJECT_ROOT
from fedrec_flwr.progress import REPLIES_LINE, ReplyProgress, RunDisplay, eta_seconds, format_duration


def _fedrec(*argv, cwd=PROJECT_ROOT, timeout=300):
    """``python -m fedrec_flwr ARGV`` (what the ``fedrec`` script runs) in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "fedrec_flwr", *argv], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )


def _tiny_pairs(tmp_path, **more) -> dict:
    data = write_tiny_dataset(tmp_path / "data")
    return {
        "dataset": "generic",
        "generic-file": str(data),
        "cache-dir": str(tmp_path / "cache"),
        "num-test-negatives": 20,
        "ks": "5,10",
        "embedding-dim": 8,
        "mlp-layers": "16,8",
        "num-server-rounds": 2,
        "fraction-train": 0.5,
        "eval-every": 1,
        "users-per-node": 12,
        "results-dir": str(tmp_path / "results"),
        "run-name": "cli",
        **more,
    }


def _toml(pairs: dict) -> str:
    return "".join(f"{k} = {launch.toml_value(v)}\n" for k, v in pairs.items())


# ------------------------------------------------------------------------------------------- version, help
def test_version_is_the_packages(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fedrec {version('fedrec-flwr')}"


def test_help_is_on_stdout_and_lists_the_subcommands():
    done = _fedrec("--help")
    assert done.returncode == 0 and done.stderr == ""
    for command in ("run", "stop", "config"):
        assert re.search(rf"^\W*{command}\s+\w", done.stdout, re.M), done.stdout
    assert "--version" in done.stdout
    run_help = _fedrec("run", "--help")
    assert run_help.returncode == 0 and "--run-config" in run_help.stdout and "--federation-config" in run_help.stdout


def test_the_console_script_is_declared_and_resolves_to_the_front_end():
    with open(PROJECT_ROOT / "pyproject.toml", "rb") as handle:
        scripts = tomllib.load(handle)["project"]["scripts"]
    assert pkgutil.resolve_name(scripts["fedrec"]) is cli.main


def test_a_bad_flag_is_one_error_line_with_exit_2(capsys):
    assert cli.main(["run", "--verbos"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--verbos" in err[0] and "fedrec run --help" in err[0]


# -------------------------------------------------------------------------------------------------- config
def test_config_prints_every_key_with_its_default_and_meaning(capsys):
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    defaults = default_mapping(PROJECT_ROOT / "pyproject.toml")
    from fedrec_flwr.config_reference import entries

    keys = entries(PROJECT_ROOT / "pyproject.toml")
    assert [k.name for k in keys] == list(defaults)
    for key in keys:  # the default as pyproject.toml writes it, then the meaning
        assert f"\n{key.name} = {key.default}\n    {key.meaning.split()[0]}" in out, key.name
    assert "# data" in out and "ml-100k | filmtrust" in out
    assert "allowed: ml-100k | filmtrust | lastfm-2k | amazon-video | generic" in out  # from RunConfig's choices


def test_config_of_one_key_and_an_unknown_key(capsys):
    assert cli.main(["config", "num-server-rounds"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "num-server-rounds = 100" and "federated rounds" in out[1]
    assert cli.main(["config", "num-server-round"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: unknown run-config key 'num-server-round'; did you mean 'num-server-rounds'")


# ---------------------------------------------------------------------------------------------- run-config file
def test_a_run_config_file_is_read_first_and_key_value_words_win(tmp_path, monkeypatch):
    pairs = _tiny_pairs(tmp_path, **{"num-server-rounds": 7, "seed": 3})
    (tmp_path / "run.toml").write_text("# a recipe\n" + _toml(pairs))
    seen = {}

    def fake_run(overrides, **kwargs):
        seen.update(overrides=dict(overrides), **kwargs)
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(launch, "flwr_run", fake_run)
    code = cli.main(
        [
            "run",
            "--run-config",
            str(tmp_path / "run.toml"),
            "seed=5",
            "--timeout",
            "30",
            "run-name=from-the-command-line",
        ]
    )
    assert code == 0
    assert seen["overrides"] == {**pairs, "seed": 5, "run-name": "from-the-command-line"}
    assert seen["num_supernodes"] == 2 and seen["timeout"] == 30.0 and seen["check"] is False
    assert seen["display"].total == 7


@pytest.mark.parametrize(
    "text, expected",
    [
        ("num-server-rounds = 2\nseed = = 3\n", "run.toml, line 2, column 8: not TOML (Invalid value)"),
        (
            "num-server-rounds = 2\n[tool.flwr.app.config]\nseed = 1\n",
            "run.toml, line 2: [tool.flwr.app.config] is a table",
        ),
        ("forget-users = [1, 2]\n", "run.toml, line 1: forget-users = [1, 2]: a run-config value is a string"),
        ("num-server-rounds = 2\nserver-lr = 0.3\n", "unknown run-config key(s) ['server-lr']"),
        ("num-server-rounds = 'x'\n", "'num-server-rounds' = 'x': expected an integer (--run-config "),
    ],
)
def test_a_bad_run_config_file_is_one_line_naming_the_file_and_line_exit_2(tmp_path, capsys, text, expected):
    (tmp_path / "run.toml").write_text(text)
    code = cli.main(["run", "--flwr-home", str(tmp_path / "home"), "--run-config", str(tmp_path / "run.toml")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --run-config " if "line" in expected[:30] else "error: ")
    assert expected in err[0], err
    assert "run.toml" in err[0] and re.search(r"line \d", err[0]), err
    assert not (tmp_path / "home").exists()  # nothing started


def test_an_unknown_key_from_the_file_names_its_line(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("num-server-rounds = 2\nserver-lr = 0.3\n")
    assert cli.main(["run", "--flwr-home", str(tmp_path / "home"), "--run-config", str(tmp_path / "run.toml")]) == 2
    assert (
        capsys.readouterr().err.strip().endswith("(--run-config " + str(tmp_path / "run.toml") + ", line 2: server-lr)")
    )


def test_a_missing_run_config_file(tmp_path, capsys):
    assert cli.main(["run", "--run-config", str(tmp_path / "nope.toml")]) == 2
    assert (
        capsys.readouterr().err.strip() == f"error: --run-config {tmp_path / 'nope.toml'}: cannot read it (No such "
        "file or directory)"
    )


# ---------------------------------------------------------------------------------------------------- progress
class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Message:
    def __init__(self, kind, server_round):
        self.metadata = type("M", (), {"message_type": kind})()
        self.content = {"config": {"server-round": server_round}}


def test_reply_progress_logs_a_long_batch_only_every_interval(caplog):
    clock = _Clock()
    report = ReplyProgress([_Message("evaluate", 3)] * 943, interval=2.0, clock=clock)
    with caplog.at_level("INFO", logger="fedrec_flwr.progress"):
        clock.now = 1.0
        report(10)  # too soon: nothing
        clock.now = 2.5
        report(120)
        clock.now = 3.0
        report(130)  # within the interval of the last line
        clock.now = 5.0
        report(943)  # all in: the round line follows, no reply line
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["replies 120/943 | evaluate round 3"]
    assert REPLIES_LINE.match(lines[0]).groups() == ("120", "943", "evaluate", "3")


def test_the_message_window_reports_the_replies_received_so_far():
    sent, counts = [], []

    class Reply:
        def __init__(self, mid):
            self.metadata = type("M", (), {"reply_to_message_id": mid})()

    def push(batch):
        ids = [str(len(sent) + i) for i in range(len(batch))]
        sent.extend(ids)
        return ids

    def pull(ids):
        return [Reply(i) for i in sorted(ids)[:2]]

    replies = send_and_receive(
        push, pull, list(range(5)), window=3, timeout=None, sleep=lambda s: None, on_reply=counts.append
    )
    assert len(replies) == 5 and counts == [2, 4, 5]


ROUND = "round    {r} | HR@10 0.4000 | NDCG@10 0.2000 | train loss 0.4000 | {s} s"


def test_plain_output_is_the_launchers_lines_unchanged():
    out = io.StringIO()
    lines = [
        "INFO fedrec_flwr.app.server_app: ready\n",
        "replies 120/943 | evaluate round 1\n",
        ROUND.format(r=1, s="10.0") + "\n",
    ]
    with RunDisplay(100, out=out) as display:  # a StringIO is no terminal
        assert not display.live
        for line in lines:
            display.feed(line, None if line.startswith("replies") else line.strip() + "\n")
    assert out.getvalue() == lines[0] + lines[2]


def test_the_live_bar_shows_round_of_total_eta_and_replies():
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140, color_system=None)
    with RunDisplay(10, out=out, live=True, console=console) as display:
        display.feed("replies 3/24 | query.identify\n", None)
        assert display.status() == "round -/10 (starting) | ETA - | query.identify: 3/24 replies"
        display.feed(ROUND.format(r=1, s="10.0") + "\n", ROUND.format(r=1, s="10.0") + "\n")
        display.feed("replies 120/943 | evaluate round 2\n", None)
        assert display.status() == "round 2/10 | ETA 1:30 | evaluate round 2: 120/943 replies"
        display.feed(ROUND.format(r=2, s="30.0") + "\n", ROUND.format(r=2, s="30.0") + "\n")
        assert display.status() == "round 3/10 | ETA 2:40"
    text = out.getvalue()
    assert ROUND.format(r=1, s="10.0") in text and "round 3/10" in text and "ETA 2:40" in text and "20%" in text


def test_eta_and_its_format():
    assert eta_seconds([], 0, 10) is None
    assert eta_seconds([10.0, 30.0], 2, 10) == 160.0
    assert eta_seconds([5.0], 12, 10) == 0.0
    assert [format_duration(s) for s in (None, 59.6, 160.0, 3723.0)] == ["-", "1:00", "2:40", "1:02:03"]


def test_the_launchers_pump_feeds_every_line_to_the_display():
    fed = []

    class Display:
        def feed(self, line, shown):
            fed.append((line, shown))

    stream = io.StringIO("INFO flwr: a Flower line\nreplies 1/2 | train round 1\n" + ROUND.format(r=1, s="1.0") + "\n")
    launch.pump_output(stream, io.StringIO(), [], io.StringIO(), False, Display())
    assert fed == [
        ("INFO flwr: a Flower line\n", None),
        ("replies 1/2 | train round 1\n", None),
        (ROUND.format(r=1, s="1.0") + "\n", ROUND.format(r=1, s="1.0") + "\n"),
    ]


# ---------------------------------------------------------------------------------------------------- real run
def test_real_one_round_fedrec_run_from_a_run_config_file(tmp_path):
    """One round of ``fedrec run --run-config FILE key=value`` on the tiny generated data (2 SuperNodes): the
    file's values and the override reach the ServerApp, the plain per-round line is printed (not a terminal)."""
    pairs = _tiny_pairs(tmp_path, **{"num-server-rounds": 5})
    (tmp_path / "run.toml").write_text(_toml(pairs))
    done = _fedrec(
        "run",
        "--flwr-home",
        str(tmp_path / "home"),
        "--federation-config",
        "client-resources-num-cpus=1",
        "--run-config",
        str(tmp_path / "run.toml"),
        "num-server-rounds=1",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^round\s+1 \| HR@10 \d\.\d{4} \|", done.stdout, re.M), done.stdout
    assert "\x1b[" not in done.stdout  # no live bar off a terminal
    folder = tmp_path / "results" / "cli"
    config = json.loads((folder / "config.json").read_text())["run-config"]
    assert config["num-server-rounds"] == 1 and config["embedding-dim"] == 8 and config["users-per-node"] == 12
    assert json.loads((folder / "summary.json").read_text())["final"]["round"] == 1


# ----------------------------------------------------------------------------------------------------- presets
def _selected(method: str, dataset: str) -> dict:
    return json.loads((PROJECT_ROOT / "experiments" / "tuning" / "results" / f"selection-{dataset}.json").read_text())[
        method
    ]["setting"]


def test_a_preset_is_the_tuned_recipe_of_the_runs_dataset_under_the_file_and_the_words(
    tmp_path, monkeypatch, ml100k_dir
):
    from experiments.tuning import grid
    from fedrec_flwr.config import make_run_config

    seen = {}
    monkeypatch.setattr(
        launch,
        "flwr_run",
        lambda overrides, **kw: (
            seen.update(overrides=dict(overrides), **kw) or subprocess.CompletedProcess([], 0, "", "")
        ),
    )
    (tmp_path / "run.toml").write_text(f'preset = "fedncf-tuned"\ndata-dir = "{ml100k_dir}"\nbatch-size = 64\n')
    words = [
        "run",
        "--run-config",
        str(tmp_path / "run.toml"),
        f"cache-dir={tmp_path / 'cache'}",
        "num-server-rounds=3",
    ]
    assert cli.main([*words, "--preset", "fedrecgel-tuned"]) == 0  # --preset wins over the file's preset
    got = seen["overrides"]
    expected = {**grid.PROTOCOL, **grid.METHODS["FedRecGEL"], **_selected("FedRecGEL", "ml-100k")}
    assert {k: got[k] for k in expected if k not in ("num-server-rounds", "batch-size")} == {
        k: v for k, v in expected.items() if k not in ("num-server-rounds", "batch-size")
    }
    assert got["num-server-rounds"] == 3 and got["batch-size"] == 64 and "preset" not in got  # file, words win
    assert seen["num_supernodes"] == 1 and seen["display"].total == 3  # users-per-node 1000: one node
    make_run_config(**got)  # a valid run config
    assert cli.main(words) == 0  # the file's preset
    assert (
        seen["overrides"]["client"] == "fedrec"
        and seen["overrides"]["learning-rate"] == _selected("FedNCF", "ml-100k")["learning-rate"]
    )


def test_presets_lists_each_recipe_with_its_table_figure_and_prints_one_as_a_run_config_file(capsys, tmp_path):
    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "fedrecgel-tuned  (FedRecGEL)" in out and "fedncf-tuned  (FedNCF)" in out
    with open(PROJECT_ROOT / "experiments" / "tuning" / "results" / "main-ml-100k.csv", newline="") as handle:
        import csv

        row = next(r for r in csv.DictReader(handle) if r["method"] == "FedRecGEL" and r["round"] == "100")
    assert f"ml-100k       test HR@10 {float(row['HR@10-mean']):.4f} at round 100" in out
    assert cli.main(["presets", "fedrecgel-tuned", "--dataset", "filmtrust"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "run.toml").write_text(text)
    values, _ = cli.read_run_config_file(tmp_path / "run.toml")
    assert values["dataset"] == "filmtrust" and values["client"] == "fedrecgel"
    assert {k: values[k] for k in _selected("FedRecGEL", "filmtrust")} == _selected("FedRecGEL", "filmtrust")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["run", "--preset", "fedrecgel-tund"],
            "preset 'fedrecgel-tund': no such preset; did you mean 'fedrecgel-tuned'?",
        ),
        (["run", "--preset", "fedrecgel-tuned", "dataset=generic"], "dataset 'generic': the presets are tuned on "),
        (["presets", "nope-tuned"], "preset 'nope-tuned': no such preset"),
    ],
)
def test_a_bad_preset_is_one_line_exit_2(tmp_path, capsys, argv, expected):
    assert cli.main([*argv, "--flwr-home", str(tmp_path / "home")] if argv[0] == "run" else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: " + expected), err
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("signame, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_ends_fedrec_run_with_128_plus_its_number(tmp_path, monkeypatch, capsys, signame, code):
    """As the launcher: a run that SIGTERM (or Ctrl-C) stops exits 128 + the signal's number, saying so."""
    import signal
    import time

    def run_then_signalled(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, signame))
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("the signal did not stop the run")

    monkeypatch.setattr(launch, "flwr_run", run_then_signalled)
    monkeypatch.setattr(launch, "check_run", lambda overrides, n=None: 1)
    assert cli.main(["run", "--flwr-home", str(tmp_path / "home")]) == code
    assert f"stopped ({signame if signame != 'SIGINT' else 'Ctrl-C'})" in capsys.readouterr().err
