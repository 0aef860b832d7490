"""The launcher's command line without a real run: parsing, exact values into Flower's own `--run-config` parser,
refusals before anything starts (one line, non-zero exit), the quiet log filter, and the run's error line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from flwr.common.config import parse_config_args

from fedrec_flwr.config import default_mapping
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.launch import (
    PROJECT_ROOT,
    check_ray_address,
    flwr_env,
    main,
    parse_args,
    parse_override,
    run_config_args,
    run_error,
    shown_quietly,
)

TRICKY = {
    "data-dir": "/data/o'brien/ml-100k",
    "run-name": "bob's-run",
    "results-dir": 'C:\\results\\"quoted" dir with  spaces',
    "generic-file": "/données/日本語/ünïcødé.csv",
    "generic-columns": "a=b c\td\nnew line 'single' \"double\" \\n literal",
    "protected-attribute": "",
    "num-server-rounds": 3,
    "learning-rate": 1e-05,
    "holdout-validation": True,
}


def test_values_reach_flower_exactly():
    """Flower's own parser (what `flwr run --run-config` calls) gives back every value unchanged."""
    args = run_config_args(TRICKY)
    assert args[0] == "--run-config"
    assert parse_config_args([args[1]]) == TRICKY


def test_command_line_values_round_trip(tmp_path):
    """From the shell words a user types to what Flower parses: apostrophes, backslashes, quotes, non-ASCII."""
    argv = [
        "run",
        "data-dir=/data/o'brien/ml-100k",
        "run-name=bob's-run",
        'results-dir=C:\\r\\"q"',
        "generic-file='/x/ü日.csv'",
        'generic-columns="user,item"',
        "num-server-rounds=2",
    ]
    _, overrides, _ = parse_args(argv)
    assert overrides == {
        "data-dir": "/data/o'brien/ml-100k",
        "run-name": "bob's-run",
        "results-dir": 'C:\\r\\"q"',
        "generic-file": "/x/ü日.csv",
        "generic-columns": "user,item",
        "num-server-rounds": 2,
    }
    assert parse_config_args([run_config_args(overrides)[1]]) == overrides


def test_bare_strings_are_accepted_for_string_keys():
    defaults = default_mapping()
    assert parse_override("dataset=filmtrust", defaults) == ("dataset", "filmtrust")
    assert parse_override("run-name=2024", defaults) == ("run-name", "2024")  # a string key keeps the text
    assert parse_override("ks=5,10", defaults) == ("ks", "5,10")
    assert parse_override("num-server-rounds=20", defaults) == ("num-server-rounds", 20)
    assert parse_override("fraction-train=0.5", defaults) == ("fraction-train", 0.5)
    assert parse_override("holdout-validation=true", defaults) == ("holdout-validation", True)


def test_spaces_around_the_equals_sign_of_one_override_are_dropped_and_quoted_ones_kept():
    """``"model = ncf"`` given as one argument passed ``' ncf'`` on (refused as an unknown model) and
    ``"run-name = x"`` made a run named ``' x'`` (a fresh user's finding); Flower's own ``--run-config`` parser skips
    such a pair silently. Now the spaces around ``=`` and the value go, and a quoted value keeps its inner ones."""
    defaults = default_mapping()
    argv = [
        "run",
        "model = ncf",
        "num-server-rounds= 5",
        " fraction-train =0.5 ",
        "run-name = ' a b '",
        "data-dir =  /data/ml-100k ",
        "adversary-class-prior = ",
    ]
    _, overrides, _ = parse_args(argv)
    assert overrides == {
        "model": "ncf",
        "num-server-rounds": 5,
        "fraction-train": 0.5,
        "run-name": " a b ",
        "data-dir": "/data/ml-100k",
        "adversary-class-prior": "",
    }
    assert parse_config_args([run_config_args(overrides)[1]]) == overrides  # what Flower's parser reads back
    with pytest.raises(ConfigError, match=r"use --num-supernodes 3$"):
        parse_override("num-supernodes = 3", defaults)


def test_bad_values_name_the_key_and_the_fix():
    defaults = default_mapping()
    with pytest.raises(ConfigError, match=r"'dataset'.*dataset=film"):
        parse_override('dataset="film', defaults)
    with pytest.raises(ConfigError, match=r"federation setting.*--num-supernodes 1000"):
        parse_override("num-supernodes=1000", defaults)
    with pytest.raises(ConfigError, match="not key=value"):
        parse_override("dataset", defaults)


def test_flags_anywhere():
    args, overrides, federation = parse_args(
        [
            "run",
            "--num-supernodes",
            "7",
            "num-server-rounds=2",
            "--verbose",
            "dataset=filmtrust",
            "--federation-config",
            "client-resources-num-cpus=1",
        ]
    )
    assert args.num_supernodes == 7 and args.verbose
    assert overrides == {"num-server-rounds": 2, "dataset": "filmtrust"}
    assert federation == {"client-resources-num-cpus": 1}


def test_an_abbreviated_flag_is_refused_not_read_as_the_flag_it_begins(capsys):
    """argparse reads an unambiguous prefix as the flag by default (``--verbos`` as ``--verbose``): refused here."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["run", "--verbos", "num-server-rounds=2"])
    assert exit_info.value.code == 2 and "--verbos" in capsys.readouterr().err


def _launch(*argv, env=None):
    return subprocess.run(
        [sys.executable, "-m", "fedrec_flwr.launch", *argv],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["num-server-rounds=abc"], "run-config key 'num-server-rounds' = 'abc': expected an integer"),
        (
            ["num-server-rounds=1e9"],
            "run-config key 'num-server-rounds' = 1000000000.0: expected an integer, got the "
            "float 1000000000.0; write 1000000000",
        ),  # was: taken as 10**9 rounds
        (["strategy=my_module:MyStrategy"], "cannot import module 'my_module'"),
        (["num-supernodes=1000"], "use --num-supernodes 1000"),
        (["server-lr=0.3"], "unknown run-config key(s) ['server-lr']"),
    ],
)
def test_errors_before_the_run_are_one_line_and_exit_non_zero(tmp_path, capsys, argv, expected):
    assert main(["run", "--flwr-home", str(tmp_path / "home"), *argv]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], out.err
    assert "Traceback" not in out.err + out.out
    assert not (tmp_path / "home").exists()  # nothing started


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["run", "--debug", "--flwr-home", str(tmp_path / "home"), "num-server-rounds=abc"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")


def test_too_many_supernodes_is_one_short_message(tmp_path, ml100k_dir):
    """`--num-supernodes 1000` on ML-100K (943 users): refused before anything starts, with the right number."""
    done = _launch(
        "run",
        "--num-supernodes",
        "1000",
        "num-server-rounds=2",
        f"data-dir={ml100k_dir}",
        f"cache-dir={tmp_path / 'cache'}",
        "--flwr-home",
        str(tmp_path / "home"),
    )
    output = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2
    assert len(output) < 20
    assert "needs exactly 943 SuperNodes" in output[-1]


def test_quiet_log_keeps_progress_warnings_and_errors():
    shown = [
        "round   10 | HR@10 0.3796 | NDCG@10 0.1967 | train loss 0.3764 | 74.3 s",
        "INFO fedrec_flwr.app.server_app: results written to /r/a",
        "WARNING fedrec_flwr.strategies.item_fedavg: 3 replies rejected",
        "WARNING :   Round 3: 2 failures",
        "ERROR :     ServerApp raised an exception",
        "fedrec_flwr.errors.ConfigError: run-config key 'resume-from' = '/x': no checkpoint at /x",
    ]
    hidden = [
        "INFO :      [ROUND 1]",
        "INFO :      configure_train: Sampled 94 nodes (out of 943)",
        "INFO :      Initial global evaluation results: None",
        "WARNING :   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2",
        "INFO :      Manually terminating ClientAppActor",
        '  File "/x/server_app.py", line 195, in main',
        "",
    ]
    assert all(shown_quietly(line) for line in shown)
    assert not any(shown_quietly(line) for line in hidden)


def test_a_plugin_loggers_lines_are_printed_with_their_level_and_kept_by_the_quiet_log(capsys):
    """A plug-in's own ``logging`` lines (a ``plugins.*`` module, as the README's plug-in section places them) get the
    ServerApp's ``LEVEL logger: message`` handler, so the launcher's default output keeps them (they used to reach
    only Python's last-resort handler: no level, no logger name, hidden by the quiet filter, INFO lost)."""
    import logging

    from fedrec_flwr.app.server_app import LOGGER_ROOTS, PROGRESS, _setup_logging

    # _setup_logging gives every logger root (and the progress logger) a handler on this test's captured stdout,
    # which pytest closes after the test: restore all of them, or a later test's log line hits a closed file
    loggers = [logging.getLogger(name) for name in LOGGER_ROOTS] + [PROGRESS]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.handlers.clear()  # an earlier test's ServerApp may have set them up, writing to that test's stdout
    try:
        _setup_logging()
        logging.getLogger("plugins.my_strategy").warning("norm-log: aggregation %d", 1)
        logging.getLogger("plugins.my_strategy").info("an info line")
    finally:
        for lg, (handlers, level, propagate) in zip(loggers, saved):
            lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
    lines = capsys.readouterr().out.splitlines()
    assert "WARNING plugins.my_strategy: norm-log: aggregation 1" in lines
    assert "INFO plugins.my_strategy: an info line" in lines
    assert all(shown_quietly(line) for line in lines)


def test_run_error_is_the_end_of_the_last_traceback():
    log = (
        "INFO :      starting\nERROR :     ServerApp raised an exception\nTraceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "fedrec_flwr.errors.ConfigError: run-config key 'resume-from' = '/x': no checkpoint at /x\n"
        "INFO :      done\n"
    )
    assert run_error(log) == "fedrec_flwr.errors.ConfigError: run-config key 'resume-from' = '/x': no checkpoint at /x"
    assert run_error("ERROR :     something\nINFO : x\n") == "ERROR :     something"
    assert run_error("all fine\n") is None


def test_deploy_local_runs_outside_the_venv_and_refuses_bad_input_in_one_line(tmp_path, ml100k_dir):
    """`python3 scripts/deploy_local.py` as the README writes it (any Python: it runs itself again with .venv's),
    with flags after the overrides: a wrong number of SuperNodes is one `error:` line and exit status 2."""
    import shutil

    python = shutil.which("python3") or sys.executable
    done = subprocess.run(
        [
            python,
            str(PROJECT_ROOT / "scripts" / "deploy_local.py"),
            "users-per-node=1",
            f"data-dir={ml100k_dir}",
            f"cache-dir={tmp_path / 'cache'}",
            "--supernodes",
            "1000",
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "943 users need exactly 943 SuperNodes" in lines[0], done.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("signame, code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_signal_ends_the_launcher_with_128_plus_its_number(tmp_path, monkeypatch, capsys, signame, code):
    """SIGTERM / SIGHUP while a run is going: the launcher stops it like Ctrl-C and exits as a shell reports a process
    that signal ended (128 + the signal's number), so a scheduler can tell a killed run from a failed one (2)."""
    import signal
    import time

    import fedrec_flwr.launch.cli as launch_cli

    def run_then_signalled(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, signame))
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("the signal did not stop the run")

    monkeypatch.setattr(launch_cli, "flwr_run", run_then_signalled)
    assert launch_cli.main(["run", "--flwr-home", str(tmp_path / "home")]) == code
    assert f"stopped ({signame})" in capsys.readouterr().err


def test_deploy_local_runs_the_preflight_before_starting_any_process(tmp_path, ml100k_dir):
    """A run the preflight refuses (here: its results folder holds a finished run) is one `error:` line and exit 2
    from `scripts/deploy_local.py` before a SuperLink or SuperNode starts (no work folder is created)."""
    finished = tmp_path / "results" / "done"
    finished.mkdir(parents=True)
    (finished / "summary.json").write_text("{}")
    done = subprocess.run(
        [
            sys.executable,
            str(PROJECT_ROOT / "scripts" / "deploy_local.py"),
            "users-per-node=472",
            f"data-dir={ml100k_dir}",
            f"cache-dir={tmp_path / 'cache'}",
            f"results-dir={tmp_path / 'results'}",
            "run-name=done",
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds a finished run" in lines[0], done.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--supernodes", "0"], "--supernodes 0: expected at least 1"),
        (["--supernodes", "-1"], "--supernodes -1: expected at least 1"),
        (["--timeout", "-5"], "--timeout -5.0: expected a positive number of seconds"),
        (
            ["--json", "/nonexistent/dir/t.json"],
            "--json /nonexistent/dir/t.json: folder /nonexistent/dir does not exist",
        ),
    ],
)
def test_deploy_local_refuses_bad_flags_before_starting_any_process(tmp_path, ml100k_dir, flags, message):
    done = subprocess.run(
        [
            sys.executable,
            str(PROJECT_ROOT / "scripts" / "deploy_local.py"),
            f"data-dir={ml100k_dir}",
            f"cache-dir={tmp_path / 'cache'}",
            "--workdir",
            str(tmp_path / "work"),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert not (tmp_path / "work").exists()


def test_flwr_env_turns_ray_task_events_off_unless_the_user_set_them(monkeypatch, tmp_path):
    """Ray's task events (one GCS record per actor call, i.e. per message) are off in ``flwr run``'s environment,
    the user's own value wins, the interpreter's folder leads PATH, and FLWR_HOME / extra values are applied."""
    monkeypatch.delenv("RAY_task_events_report_interval_ms", raising=False)
    env = flwr_env(tmp_path / "home", {"FLWR_LOCAL_CONTROL_API_PORT": "40001"})
    assert env["RAY_task_events_report_interval_ms"] == "0"
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert env["FLWR_HOME"] == str(tmp_path / "home")
    assert env["FLWR_LOCAL_CONTROL_API_PORT"] == "40001"
    assert env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
    monkeypatch.setenv("RAY_task_events_report_interval_ms", "1000")
    assert flwr_env()["RAY_task_events_report_interval_ms"] == "1000"


def test_an_unreachable_or_malformed_ray_address_is_refused_before_anything_starts(tmp_path):
    """Ray retries an unreachable address without end inside the simulation, so ``flwr run`` would wait silently:
    the launcher refuses it first, in one line, exit 2 (a port nothing listens on: one we bound and closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"--ray-address '127.0.0.1:{port}': no Ray head answers there"):
        check_ray_address(f"127.0.0.1:{port}")
    for bad in ("nothere", "host:", ":6379", "host:99999", "host:port"):
        with pytest.raises(ConfigError, match="expected host:port of a Ray head"):
            check_ray_address(bad)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_ray_address(f"127.0.0.1:{listening.getsockname()[1]}")
        check_ray_address(f"ray://127.0.0.1:{listening.getsockname()[1]}")
    check_ray_address("auto")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedrec_flwr.launch",
            "run",
            "--ray-address",
            f"127.0.0.1:{port}",
            f"results-dir={str(tmp_path)!r}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PROJECT_ROOT,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: --ray-address"), done.stderr
    assert not any(tmp_path.iterdir())
