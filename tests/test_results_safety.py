"""A run's results are never lost or written elsewhere, and bad command lines are refused in one line before anything
starts (exit 2), as a new user following the README meets them: resuming a finished run, re-running an interrupted
one without ``resume-from``, an unusable ``results-dir`` or ``--flwr-home``, a ``run-name`` that is a path, unknown
``--federation-config`` keys, a plug-in that fails on import, keys given twice; and a failed run's last line names
its first cause. Tiny generated data, ``run_serial`` or ``launch.main`` up to the preflight: no Ray, no SuperLink."""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

import pytest
from conftest import tiny_run_config

from fedrec_flwr import launch
from fedrec_flwr.config import RunConfig, default_mapping
from fedrec_flwr.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

USERS_PER_NODE = 6  # the tiny dataset's 24 users on 4 nodes


def _pairs(mapping: dict) -> list[str]:
    """``key=value`` words for the launcher: the keys that differ from the defaults."""
    defaults = default_mapping(launch.PROJECT_ROOT / "pyproject.toml")
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in mapping.items() if v != defaults.get(k)]


def _launch(capsys, tmp_path: Path, *words: str) -> tuple[int, list[str]]:
    """``python -m fedrec_flwr.launch run <words>``: the exit status and the lines on stderr."""
    code = launch.main(["run", "--flwr-home", str(tmp_path / "home"), *words])
    return code, capsys.readouterr().err.strip().splitlines()


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-round run with a checkpoint every round and client state files (the tester's ``fin``)."""
    from fedrec_flwr.serial import run_serial

    logging.getLogger("flwr").setLevel(logging.WARNING)
    base = tmp_path_factory.mktemp("finished")
    config = tiny_run_config(
        base,
        users_per_node=USERS_PER_NODE,
        num_server_rounds=2,
        checkpoint_every=1,
        client_state_dir=str(base / "client-state"),
        run_name="fin",
    )
    folder = run_serial(config)
    assert (folder / "summary.json").is_file() and (folder / "checkpoint.npz").is_file()
    return base, config, folder


def test_resuming_a_finished_run_is_refused_and_rewrites_nothing(finished, tmp_path, capsys):
    """Defect 1: resuming a finished run exited 0 and rewrote final_arrays.npz without its arrays (460 KB -> 22 bytes)
    and summary.json. Now: exit 2, one line naming resume-from and saying the folder holds a finished run; every
    file of the folder unchanged; the same refusal from run_serial (the ServerApp's own preflight)."""
    from fedrec_flwr.serial import run_serial

    _, config, folder = finished
    before = _digests(folder)
    resume = {**config, "resume-from": str(folder)}
    code, lines = _launch(capsys, tmp_path, *_pairs(resume))
    assert code == 2, lines
    assert len(lines) == 1 and "'resume-from'" in lines[0] and "holds a finished run" in lines[0], lines
    with pytest.raises(ConfigError, match=r"'resume-from' = .*holds a finished run"):
        run_serial(resume)
    assert _digests(folder) == before


def test_rerunning_an_interrupted_run_without_resume_from_keeps_its_checkpoint(finished, tmp_path, capsys):
    """Defect 2: the same command again, without resume-from, over an interrupted run (checkpoint.npz, no
    summary.json) deleted its checkpoint and started afresh. Now: exit 2, one line pointing to resume-from=<folder>;
    the checkpoint stays; run_serial refuses too."""
    import shutil

    from fedrec_flwr.serial import run_serial

    base, config, folder = finished
    interrupted = tmp_path / "results" / "fin"
    shutil.copytree(folder, interrupted)
    (interrupted / "summary.json").unlink()
    config = {**config, "results-dir": str(tmp_path / "results")}
    before = _digests(interrupted)
    code, lines = _launch(capsys, tmp_path, *_pairs(config))
    assert code == 2, lines
    assert len(lines) == 1 and f"resume-from={str(interrupted.resolve())!r}" in lines[0], lines
    with pytest.raises(ConfigError, match="holds an interrupted run's checkpoint"):
        run_serial(config)
    assert _digests(interrupted) == before


def test_a_results_dir_where_no_folder_can_be_made_is_refused_by_the_preflight(tmp_path, capsys):
    """Defect 3: results-dir=/proc/nope passed the preflight (os.access says yes to root) and failed 56 s into the
    simulation with FileNotFoundError printed 4 times. Now the preflight probes it: exit 2, one line naming
    results-dir; nothing created."""
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc")
    mapping = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, results_dir="/proc/nope")
    code, lines = _launch(capsys, tmp_path, *_pairs(mapping))
    assert code == 2, lines
    assert len(lines) == 1 and "run-config key 'results-dir' = '/proc/nope'" in lines[0], lines
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("name", ["../escape", "<absolute>", "a/b", "..", "a\\b"])
def test_a_run_name_that_is_a_path_is_refused(tmp_path, capsys, name):
    """Defect 4: run-name=../escape wrote outside results-dir, run-name=/abs/path ignored it. Now: exit 2, one line
    naming the key and the value; nothing written anywhere."""
    name = str(tmp_path / "elsewhere" / "run") if name == "<absolute>" else name
    (tmp_path / "results").mkdir()
    mapping = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, run_name=name)
    code, lines = _launch(capsys, tmp_path, *_pairs(mapping))
    assert code == 2, lines
    assert len(lines) == 1 and f"run-config key 'run-name' = {name!r}" in lines[0], lines
    assert not (tmp_path / "escape").exists() and not (tmp_path / "elsewhere").exists()
    assert list((tmp_path / "results").iterdir()) == []


@pytest.mark.parametrize(
    "pair, expected",
    [
        ("foo=1", "Flower knows no simulation setting 'foo'"),
        (
            "client-resources-num-cpus=abc",
            "--federation-config client-resources-num-cpus=abc: Flower refuses the value",
        ),
        ("client-resources-num-cpus=-1", "--federation-config client-resources-num-cpus=-1: Flower refuses the value"),
        ("num-supernodes=3", "use --num-supernodes 3"),
    ],
)
def test_federation_config_is_checked_as_flower_checks_it(tmp_path, capsys, pair, expected):
    """Defect 5: an unknown --federation-config key (or a non-integer CPU count) started the SuperLink and failed
    19 s later with 'status unknown ... the SuperLink knows no run', Flower's own reason only in the log. Now
    Flower's own check (simulation_config_from_json) runs on the command line: exit 2, one line, nothing started."""
    code, lines = _launch(capsys, tmp_path, "--federation-config", pair, "num-server-rounds=1")
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "home").exists()
    # what Flower accepts passes
    _, _, federation = launch.parse_args(
        ["run", "--federation-config", "client-resources-num-cpus=1", "--federation-config", "init-args-num-cpus=2"]
    )
    assert federation == {"client-resources-num-cpus": 1, "init-args-num-cpus": 2}


FAILED_RUN_LOG = """\
INFO :      [ROUND 1]
INFO :      configure_train: Sampling failed: cannot sample 10 from 10 nodes
ERROR :     ServerApp thread raised an exception: Missing required key 'nosuch'
ERROR :     Traceback (most recent call last):
  File "/x/flwr/server/serverapp/app.py", line 200, in run_serverapp
    updated_context = run_(
  File "/x/flwr/serverapp/strategy/strategy_utils.py", line 80, in validate_message_reply_consistency
    raise InconsistentMessageReplies(reason=f"Missing required key `{weighted_by_key}` in reply.")
flwr.serverapp.exception.InconsistentMessageReplies: Missing required key 'nosuch'
ERROR fedrec_flwr.app.server_app: the ServerApp has ended: InconsistentMessageReplies: Missing required key 'nosuch'
ERROR :     Exit Code: 700
Traceback (most recent call last):
  File "/x/flwr/simulation/app.py", line 10, in main
RuntimeError: Exit Code: 700
"""


def test_a_failed_runs_last_line_names_its_first_cause():
    """Defect 6: a run failing in round 1 ended with 'error: the run did not finish (finished:failed): ERROR : Exit
    Code: 700'; the cause was only earlier. Now the ServerApp's own last line (its exception), else the first
    exception line, is the error."""
    assert launch.run_error(FAILED_RUN_LOG) == "InconsistentMessageReplies: Missing required key 'nosuch'"
    without_ours = "\n".join(line for line in FAILED_RUN_LOG.splitlines() if "fedrec_flwr" not in line)
    assert (
        launch.run_error(without_ours)
        == "flwr.serverapp.exception.InconsistentMessageReplies: Missing required key 'nosuch'"
    )
    completed = "INFO fedrec_flwr.app.server_app: the ServerApp has ended: completed\nERROR :     Exit Code: 700\n"
    assert launch.run_error(completed) == "ERROR :     Exit Code: 700"
    # flwr run's own refusal (defect 5's key, had it passed the launcher): typer's Error box, as Flower prints it
    refused = (
        "Loading project configuration...\n╭─ Error ─────────────────────────────╮\n"
        "│ Unknown simulation config field(s): foo │\n╰─────────────────────────────────────╯\n"
    )
    assert launch.run_error(refused) == "Unknown simulation config field(s): foo"


def test_an_unusable_flwr_home_is_one_error_line(tmp_path, capsys):
    """Defect 7: --flwr-home /proc/x printed a 28-line traceback (exit 1). Now one line naming --flwr-home, exit 2."""
    mapping = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE)
    code = launch.main(["run", "--flwr-home", "/proc/x", *_pairs(mapping)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: --flwr-home /proc/x"), lines


def test_a_plugin_that_fails_on_import_is_one_error_line(tmp_path, capsys, monkeypatch):
    """Defect 8: a plug-in module raising NameError at import gave a 37-line traceback, exit 1. Now one line with the
    error, its file and line, exit 2."""
    (tmp_path / "plugin_broken_at_import.py").write_text(
        "from fedrec_flwr.strategies.item_fedavg import ItemEmbeddingFedAvg\n\nsteps = undefined_name\n\n\n"
        "class Broken(ItemEmbeddingFedAvg):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mapping = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, strategy="plugin_broken_at_import:Broken")
    code, lines = _launch(capsys, tmp_path, *_pairs(mapping))
    assert code == 2, lines
    assert len(lines) == 1 and "run-config key 'strategy' = 'plugin_broken_at_import:Broken'" in lines[0], lines
    assert "NameError: name 'undefined_name' is not defined" in lines[0] and "line 3" in lines[0], lines


def test_a_plugin_whose_own_import_is_missing_names_its_file_and_line(tmp_path, monkeypatch):
    """A plug-in found but importing a package that is not installed: the error names the plug-in's file and the line
    of that import, not only the missing package (a missing plug-in module keeps 'cannot import module')."""
    from fedrec_flwr.errors import ConfigError
    from fedrec_flwr.registry import resolve

    (tmp_path / "plugin_missing_dependency.py").write_text("import math\nimport nonexistent_pkg_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError,
        match=r"module 'plugin_missing_dependency' fails on import: "
        r"ModuleNotFoundError: No module named 'nonexistent_pkg_xyz' "
        r"\(.*plugin_missing_dependency.py, line 2\)",
    ):
        resolve("strategy", "plugin_missing_dependency:X")
    with pytest.raises(ConfigError, match="cannot import module 'plugin_not_there_at_all'"):
        resolve("strategy", "plugin_not_there_at_all:X")


def test_the_readme_plugin_snippet_runs_as_copied(tmp_path, monkeypatch):
    """The first-strategy tutorial's ServerLrItemFedAvg snippet (docs/tutorials/first-strategy.md), copied into a file
    as it stands, imports and runs a round."""
    from fedrec_flwr.serial import run_serial

    readme = (launch.PROJECT_ROOT / "docs" / "tutorials" / "first-strategy.md").read_text()
    snippet = next(
        block for block in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "class ServerLrItemFedAvg" in block
    )
    (tmp_path / "readme_server_lr.py").write_text(snippet)
    monkeypatch.syspath_prepend(str(tmp_path))
    logging.getLogger("flwr").setLevel(logging.WARNING)
    folder = run_serial(
        tiny_run_config(
            tmp_path,
            users_per_node=USERS_PER_NODE,
            num_server_rounds=1,
            strategy="readme_server_lr:ServerLrItemFedAvg",
            server_lr=0.3,
        )
    )
    assert (folder / "summary.json").is_file()


def test_a_key_given_twice_and_a_repeated_k_are_refused(tmp_path, capsys):
    """Defect 9: num-server-rounds=1 num-server-rounds=2 silently took the last, and ks=5,5 was accepted. Now both
    are refused before anything starts, naming the key."""
    code, lines = _launch(capsys, tmp_path, "num-server-rounds=1", "num-server-rounds=2")
    assert code == 2 and len(lines) == 1 and "'num-server-rounds' is given twice" in lines[0], lines
    code, lines = _launch(
        capsys,
        tmp_path,
        "--federation-config",
        "client-resources-num-cpus=1",
        "--federation-config",
        "client-resources-num-cpus=2",
    )
    assert code == 2 and len(lines) == 1 and "'client-resources-num-cpus' is given twice" in lines[0], lines
    with pytest.raises(ConfigError, match=r"run-config key 'ks' = '5,5': a cut-off is given twice"):
        RunConfig.from_mapping(tiny_run_config(tmp_path, ks="5,5"))
    code, lines = _launch(capsys, tmp_path, *_pairs(tiny_run_config(tmp_path, ks="10,5,10")))
    assert code == 2 and len(lines) == 1 and "run-config key 'ks' = '10,5,10'" in lines[0], lines
    assert not (tmp_path / "home").exists()


def test_metrics_csv_writes_counts_as_integers_and_rates_as_floats(tmp_path):
    """Counts (users, replies, failures) arrive as floats on the wire; metrics.csv/json show them as integers."""
    import csv
    import json

    from fedrec_flwr.state.results import RunRecorder

    recorder = RunRecorder(tmp_path / "run", {"rounds": 1}, {})
    recorder.record(
        1,
        {"train-loss": 0.5, "train-users": 12.0, "num-replies": 4.0, "num-failures": 0.0},
        {"HR@10": 1.0, "eval-users": 12.0},
    )
    with open(tmp_path / "run" / "metrics.csv") as handle:
        row = next(csv.DictReader(handle))
    assert (row["train-users"], row["num-replies"], row["num-failures"], row["eval-users"]) == ("12", "4", "0", "12")
    assert row["train-loss"] == "0.5" and row["HR@10"] == "1.0"
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())[0]
    assert isinstance(saved["train-users"], int) and isinstance(saved["HR@10"], float)


def test_the_learning_curve_marks_the_unlearning_phase(tmp_path, monkeypatch):
    """A run with an unlearning phase draws a dashed line after its round on both panels, named in the legend."""
    import matplotlib.axes

    from fedrec_flwr.state.results import RunRecorder

    drawn = []
    original = matplotlib.axes.Axes.axvline
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "axvline",
        lambda self, x=0, *a, **k: drawn.append((x, k.get("label"))) or original(self, x, *a, **k),
    )
    recorder = RunRecorder(tmp_path / "run", {}, {})
    for r in (1, 2, 3, 4):
        recorder.record(r, {"train-loss": 0.5}, {"HR@10": 0.1 * r, "NDCG@10": 0.05 * r})
    recorder.finish({}, {"unlearning": {"method": "hfkcu", "round": 2}})
    assert drawn == [(2.5, "unlearning (hfkcu)"), (2.5, None)]
    drawn.clear()
    RunRecorder(tmp_path / "plain", {}, {}).finish({}, {})
    assert drawn == [] and (tmp_path / "plain" / "learning_curves.png").is_file()


def test_metrics_csv_starts_with_round_and_seconds_also_for_rows_restored_from_a_checkpoint(tmp_path):
    from fedrec_flwr.state.results import RunRecorder

    restored = [{"HR@10": 0.1, "num-failures": 0, "round": 1, "seconds": 1.0, "train-loss": 0.6}]  # sorted keys
    recorder = RunRecorder(tmp_path / "run", {}, {}, rows=restored)
    recorder.record(2, {"train-loss": 0.5}, {})
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:2] == ["round", "seconds"]


def test_a_new_run_replacing_an_interrupted_run_without_a_checkpoint_says_so(tmp_path, caplog):
    """An interrupted run's partial metrics (no summary.json, no checkpoint) were replaced silently."""
    import logging

    from fedrec_flwr.state.results import check_results_folder

    (tmp_path / "metrics.csv").write_text("round,HR@10\n1,0.3\n")
    caplog.set_level(logging.WARNING, logger="fedrec_flwr")
    package_logger = logging.getLogger("fedrec_flwr")  # the ServerApp's handler may stop propagation
    package_logger.addHandler(caplog.handler)
    try:
        check_results_folder(tmp_path)
        check_results_folder(tmp_path)  # nothing left: no second warning
    finally:
        package_logger.removeHandler(caplog.handler)
    assert not (tmp_path / "metrics.csv").exists()
    assert caplog.text.count("held an interrupted run without a checkpoint (metrics.csv, no summary.json)") == 1


@pytest.mark.parametrize("evaluated_rounds", [(5,), (1, 2, 3, 4, 5), (2, 4)])
def test_the_learning_curve_legend_covers_no_plotted_point_of_a_short_run(evaluated_rounds):
    """A 5-round run's points (the last one at the right edge, evaluated after the last round) stay visible: the
    legend's box, in display coordinates, holds no marker of either panel, with or without an unlearning mark."""
    import matplotlib.pyplot as plt
    import numpy as np

    from fedrec_flwr.state.results import learning_curves_figure

    rows = [{"round": r, "train-loss": 0.69 - 0.05 * r} for r in range(1, 6)]
    for row in rows:
        if row["round"] in evaluated_rounds:
            row.update({"HR@10": 0.2 + 0.02 * row["round"], "NDCG@10": 0.1 + 0.01 * row["round"]})
    for marks in ({}, {"unlearning (hfkcu)": 3}):
        fig = learning_curves_figure(rows, title="short", marks=marks)
        try:
            renderer = fig.canvas.get_renderer()
            fig.canvas.draw()
            legends = [axis.get_legend() for axis in fig.axes if axis.get_legend() is not None] + fig.legends
            assert legends, "the HR@10 / NDCG@10 panel has a legend"
            boxes = [legend.get_window_extent(renderer) for legend in legends]
            points = [
                axis.transData.transform(np.column_stack(line.get_data()))  # the curves, not the dashed mark
                for axis in fig.axes
                for line in axis.lines
                if line.get_linestyle() != "--"
            ]
            assert sum(len(block) for block in points) == 2 * len(evaluated_rounds) + 5
            covered = [
                (x, y)
                for block in points
                for x, y in block
                for box in boxes
                if box.x0 - 6 <= x <= box.x1 + 6 and box.y0 - 6 <= y <= box.y1 + 6
            ]  # 6 px: a marker's radius
            assert covered == []
        finally:
            plt.close(fig)


@pytest.mark.parametrize("hr10", [0.935, 1.0])
def test_the_highest_learning_curve_marker_stays_inside_the_panel(hr10):
    """A short run's single evaluated point near or at HR@10 1.0 (FilmTrust) was cut by the panel's top edge: the
    marker's centre must lie at least a marker's radius (6 px) below the top of the axes."""
    import matplotlib.pyplot as plt

    from fedrec_flwr.state.results import learning_curves_figure

    rows = [{"round": 1, "train-loss": 0.6}, {"round": 2, "train-loss": 0.5, "HR@10": hr10, "NDCG@10": 0.73}]
    fig = learning_curves_figure(rows, title="short")
    try:
        fig.canvas.draw()
        left = fig.axes[0]
        top = left.get_window_extent().y1
        y = left.transData.transform((2, hr10))[1]
        assert top - y >= 6
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------- failed runs
def _fail_in_round(failing_round: int, kind=RuntimeError):
    """A client mod that raises ``kind`` in every train message of ``failing_round`` (every reply an error: with
    min-train-fraction 0.5 the round fails with RoundFailed; the serial grid raises a KeyboardInterrupt through)."""

    def mod(message, context, call_next):
        config = message.content["config"] if "config" in message.content else {}
        if message.metadata.message_type == "train" and config.get("server-round") == failing_round:
            raise kind(f"injected failure in round {failing_round}")
        return call_next(message, context)

    return mod


def _read(path: Path):
    import json

    return json.loads(path.read_text())


def _warnings_of(caplog, action):
    """Run ``action()`` with the package's warnings captured (the ServerApp's handler may stop propagation)."""
    caplog.set_level(logging.WARNING, logger="fedrec_flwr")
    package_logger = logging.getLogger("fedrec_flwr")
    package_logger.addHandler(caplog.handler)
    try:
        return action()
    finally:
        package_logger.removeHandler(caplog.handler)


def test_a_run_that_fails_in_a_round_records_it_and_its_run_name_is_replaced_by_the_next_run(tmp_path, caplog):
    """A new user's finding: a run failing in round 2 left config.json and the metrics (nothing said it failed), and
    the same run-name was accepted again with no word. Now the folder holds failed.json (the error, the round, the
    rounds completed; no summary.json), and the next run of that name replaces it with a warning naming the
    failure, then holds a finished run, which a third run may not overwrite."""
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.serial import run_serial
    from fedrec_flwr.strategies.item_fedavg import RoundFailed

    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, num_server_rounds=3, run_name="flaky")
    folder = tmp_path / "results" / "flaky"
    with pytest.raises(RoundFailed, match="round 2"):
        run_serial(config, client_app=make_client_app(config, mods=[_fail_in_round(2)]))
    record = _read(folder / "failed.json")
    assert record["round"] == 2 and record["rounds-completed"] == 1 and record["num-server-rounds"] == 3
    assert record["error-type"] == "RoundFailed" and record["error"].startswith("RoundFailed: round 2")
    assert "injected failure in round 2" in record["error"] and "\n" not in record["error"]
    assert not (folder / "summary.json").exists() and [r["round"] for r in _read(folder / "metrics.json")] == [1]
    (folder / "provenance.json").write_text("{}")  # not a file of the run's: it stays

    caplog.clear()
    assert _warnings_of(caplog, lambda: run_serial(config)) == folder.resolve()
    assert (
        caplog.text.count(
            f"results folder {folder.resolve()} held a failed run (failed in round 2: RoundFailed: round 2"
        )
        == 1
    ), caplog.text
    assert (
        "config.json, metrics.csv, metrics.json, failed.json, no summary.json): this run replaces its files"
        in caplog.text
    )
    assert not (folder / "failed.json").exists() and (folder / "summary.json").is_file()
    assert [r["round"] for r in _read(folder / "metrics.json")] == [1, 2, 3]
    assert (folder / "provenance.json").read_text() == "{}"
    with pytest.raises(ConfigError, match="already holds a finished run"):
        run_serial(config)


def test_a_failed_run_with_a_checkpoint_is_resumed_and_its_failure_record_removed(tmp_path, caplog):
    """The failure record does not change the checkpoint rule: the same run-name without resume-from is refused,
    resume-from continues after the checkpoint, says it drops the record, and the folder ends as a finished run."""
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.serial import run_serial
    from fedrec_flwr.strategies.item_fedavg import RoundFailed

    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = tiny_run_config(
        tmp_path, users_per_node=USERS_PER_NODE, num_server_rounds=3, checkpoint_every=1, run_name="flaky"
    )
    folder = (tmp_path / "results" / "flaky").resolve()
    with pytest.raises(RoundFailed):
        run_serial(config, client_app=make_client_app(config, mods=[_fail_in_round(3)]))
    assert _read(folder / "failed.json")["round"] == 3 and (folder / "checkpoint.npz").is_file()
    with pytest.raises(ConfigError, match="holds an interrupted run's checkpoint"):
        run_serial(config)
    resume = {**config, "resume-from": str(folder), "resume-resets-client-state": True}
    caplog.clear()
    assert _warnings_of(caplog, lambda: run_serial(resume)) == folder
    assert (
        "held a failed run (failed in round 3: RoundFailed: " in caplog.text and "failed.json is removed" in caplog.text
    )
    assert not (folder / "failed.json").exists() and (folder / "summary.json").is_file()
    assert [r["round"] for r in _read(folder / "metrics.json")] == [1, 2, 3]


def test_an_interrupted_run_writes_no_failure_record(tmp_path):
    """Ctrl-C (KeyboardInterrupt) stops a run; it did not fail, so no failed.json (the experiments' grids skip
    failed points for good, and must redo interrupted ones)."""
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.serial import run_serial

    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, num_server_rounds=2, run_name="stopped")
    with pytest.raises(KeyboardInterrupt):
        run_serial(config, client_app=make_client_app(config, mods=[_fail_in_round(2, KeyboardInterrupt)]))
    folder = tmp_path / "results" / "stopped"
    assert (folder / "config.json").is_file() and not (folder / "failed.json").exists()


def test_a_folder_holding_only_a_config_is_replaced_with_a_warning(tmp_path, caplog):
    """What an earlier version left of a run that failed in round 1 (config.json alone) was reused with no word."""
    from fedrec_flwr.state.results import check_results_folder

    (tmp_path / "config.json").write_text("{}")
    _warnings_of(caplog, lambda: check_results_folder(tmp_path))
    assert not (tmp_path / "config.json").exists()
    assert "held an interrupted run without a checkpoint (config.json, no summary.json)" in caplog.text


def test_a_failure_record_is_one_atomic_json_object(tmp_path):
    from fedrec_flwr.state.results import read_failure, write_failure

    path = write_failure(tmp_path, ValueError("two\nlines"), server_round=None, rounds_completed=3, num_server_rounds=3)
    record = read_failure(tmp_path)
    assert path == tmp_path / "failed.json" and record["error"] == "ValueError: two lines" and record["round"] is None
    assert record["rounds-completed"] == 3 and record["failed-at"].endswith("Z")
    assert [p.name for p in tmp_path.iterdir()] == ["failed.json"]  # no temporary file left
    path.write_text("not json")
    assert read_failure(tmp_path) == {"error": "unreadable failed.json"}
