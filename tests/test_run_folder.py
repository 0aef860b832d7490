"""A run's folders: one rule for what a run's name may be (the results folder's and the clients' state folder's),
checked before anything starts; a results folder belongs to one live run; a resume on changed data is refused; a
dead writer's temporary files are cleaned up. Tiny generated data, ``run_serial`` or ``launch.main`` up to the
preflight."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import tiny_run_config

from fedrec_flwr import launch
from fedrec_flwr.config import default_mapping
from fedrec_flwr.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

USERS_PER_NODE = 6  # the tiny dataset's 24 users on 4 nodes


@pytest.fixture(autouse=True)
def _own_log_handlers():
    """The console handlers a run sets up (``server_app._setup_logging``) write to the ``sys.stdout`` of their test's
    capture; they are removed after it, so a later test's lines do not go to a closed stream."""
    from fedrec_flwr.registry import LOGGER_ROOTS
    from fedrec_flwr.state.results import PROGRESS

    loggers = [logging.getLogger(name) for name in LOGGER_ROOTS] + [PROGRESS]
    before = {logger.name: (list(logger.handlers), logger.propagate, logger.level) for logger in loggers}
    yield
    for logger in loggers:
        handlers, propagate, level = before[logger.name]
        for handler in [h for h in logger.handlers if h not in handlers]:
            logger.removeHandler(handler)
        logger.propagate, logger.level = propagate, level


def _pairs(mapping: dict) -> list[str]:
    """``key=value`` words for the launcher: the keys that differ from the defaults (strings TOML-quoted)."""
    import json

    defaults = default_mapping(launch.PROJECT_ROOT / "pyproject.toml")
    return [
        f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
        for k, v in mapping.items()
        if v != defaults.get(k)
    ]


def _launch(capsys, tmp_path: Path, *words: str) -> tuple[int, list[str]]:
    """``python -m fedrec_flwr.launch run <words>``: the exit status and the lines on stderr."""
    code = launch.main(["run", "--flwr-home", str(tmp_path / "home"), *words])
    return code, capsys.readouterr().err.strip().splitlines()


# ------------------------------------------------------------------------------------------------ run names
BAD_NAMES = {
    "too-long-ascii": "r" * 256,
    "too-long-bytes": "\u5b57" * 90,  # 90 CJK characters, 270 bytes in UTF-8
    "201-characters": "a" * 201,
    "space": "my run",
    "non-ascii": "M\u00fcller",
    "hidden": "_scratch",
    "dot-first": ".hidden",
    "parentheses": "run(1)",
    "newline": "a\nb",
    "trailing-newline": "a\n",
}


@pytest.mark.parametrize("case", sorted(BAD_NAMES))
def test_a_run_name_the_clients_state_folder_would_refuse_is_refused_by_the_preflight(tmp_path, case):
    """Every entry point's preflight refuses, in one line naming the key and the (escaped) value, a name that the
    file system or the clients' state folder would refuse later (in round 1, or after the identify phase)."""
    from fedrec_flwr.serial import run_serial

    name = BAD_NAMES[case]
    mapping = tiny_run_config(
        tmp_path, users_per_node=USERS_PER_NODE, run_name=name, client_state_dir=str(tmp_path / "state")
    )
    with pytest.raises(ConfigError) as caught:
        run_serial(mapping)
    message = str(caught.value)
    assert "\n" not in message and f"run-config key 'run-name' = {name!r}:" in message, message
    assert not (tmp_path / "results").exists() and not (tmp_path / "state").exists()


@pytest.mark.parametrize("case", ["too-long-ascii", "space", "non-ascii", "parentheses"])
def test_the_launcher_refuses_such_a_run_name_before_anything_starts(tmp_path, capsys, case):
    mapping = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, run_name=BAD_NAMES[case])
    code, lines = _launch(capsys, tmp_path, *_pairs(mapping))
    assert code == 2, lines
    assert len(lines) == 1 and "run-config key 'run-name' = " in lines[0], lines
    assert not (tmp_path / "home").exists() and not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "name", ["a", "learning-rate=0.03-seed0", "rho-shared=0.02,server-lr=0.03-seed1", "Run_1.v2+x", "x" * 200]
)
def test_every_name_the_preflight_accepts_names_a_clients_state_folder(tmp_path, name):
    """One rule: a name the preflight lets through is one the clients' state folder takes."""
    from fedrec_flwr.app.preflight import preflight
    from fedrec_flwr.state.client_state import RUN_KEY, state_folder

    plan = preflight(tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, run_name=name))
    assert plan.folder.name == name
    assert state_folder({}, str(tmp_path / "state"), {RUN_KEY: plan.folder.name}) == tmp_path / "state" / name


def test_a_generated_run_name_follows_the_rule(tmp_path):
    """A plug-in's class name may hold characters the rule refuses, a dataset name may be long."""
    from types import SimpleNamespace

    from fedrec_flwr.app.preflight import default_run_name
    from fedrec_flwr.state.client_state import run_name_problem

    config = SimpleNamespace(
        run_name="",
        dataset="_my data" * 40,
        model="mf",
        client="my_pkg:My Client (v2)",
        strategy="item-fedavg",
        unlearning="none",
    )
    name = default_run_name(config)
    assert run_name_problem(name) is None, name


def test_a_resume_from_a_folder_whose_name_breaks_the_rule_is_refused(tmp_path):
    """A resumed run keeps its folder's name (the clients' state folder is named after it): a checkpoint's folder
    renamed to ``my run`` would fail in round 1 on every node; it is refused before anything starts."""
    import numpy as np

    from fedrec_flwr.app.preflight import preflight
    from fedrec_flwr.config import RunConfig
    from fedrec_flwr.state.checkpoint import Checkpoint, save_checkpoint

    mapping = tiny_run_config(
        tmp_path,
        users_per_node=USERS_PER_NODE,
        run_name="ok",
        checkpoint_every=1,
        client_state_dir=str(tmp_path / "state"),
    )
    folder = tmp_path / "results" / "my run"
    save_checkpoint(
        folder,
        Checkpoint(
            server_round=1,
            run_name="ok",
            run_config=RunConfig.from_mapping(mapping).to_dict(),
            arrays={"w": np.zeros(1)},
            client_state=True,
        ),
    )
    with pytest.raises(ConfigError, match=r"'resume-from' = .*: the checkpoint's folder name 'my run' cannot name"):
        preflight({**mapping, "resume-from": str(folder)})


# ------------------------------------------------------------------------------------------------ one run a folder
def test_two_generated_run_names_of_the_same_second_differ():
    """Two runs started in the same second with ``run-name = ""`` got the same folder; the name now holds the pid and
    a random part."""
    from fedrec_flwr.app.preflight import default_run_name
    from fedrec_flwr.config import make_run_config

    config = make_run_config(run_name="")
    names = {default_run_name(config) for _ in range(20)}
    assert len(names) == 20, names
    assert all(f"-p{__import__('os').getpid()}-" in name for name in names)


def test_a_second_run_of_a_live_runs_folder_is_refused_naming_the_holder(tmp_path, capsys):
    """The same run-name started while the first run is still going: refused (run_serial and the launcher), naming
    the live run's pid; the first run finishes with its own files, and its lock is gone afterwards."""
    import os

    from fedrec_flwr.serial import run_serial
    from fedrec_flwr.state.results import lock_path

    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, num_server_rounds=2, run_name="shared")
    refusals = []

    def second_run(view):
        if view.server_round == 1:
            with pytest.raises(ConfigError) as caught:
                run_serial({**config, "seed": 1})
            refusals.append(str(caught.value))
            refusals.append(_launch(capsys, tmp_path, *_pairs({**config, "seed": 1})))

    folder = run_serial(config, on_round=second_run)
    message, (code, lines) = refusals
    assert f"in use by a live run (pid {os.getpid()} on host" in message and "\n" not in message, message
    assert code == 2 and len(lines) == 1 and f"pid {os.getpid()}" in lines[0], lines
    summary = __import__("json").loads((folder / "config.json").read_text())
    assert summary["run-config"]["seed"] == 0 and (folder / "summary.json").is_file()
    assert not lock_path(folder).exists()


def test_a_lock_file_left_by_a_dead_process_does_not_block(tmp_path):
    """A SIGKILLed run leaves its lock file, but no lock: the next run of the folder takes it over."""
    import json
    import subprocess
    import sys

    from fedrec_flwr.serial import run_serial
    from fedrec_flwr.state.results import FolderLock, lock_path

    logging.getLogger("flwr").setLevel(logging.WARNING)
    folder = tmp_path / "results" / "again"
    held = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal, sys; from fedrec_flwr.state.results import FolderLock; "
            f"FolderLock({str(folder)!r}).acquire(); os.kill(os.getpid(), signal.SIGKILL)",
        ],
        env={**__import__("os").environ},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert held.returncode == -9, held.stderr
    assert json.loads(lock_path(folder).read_text())["pid"] != __import__("os").getpid()  # the dead one's
    config = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, num_server_rounds=1, run_name="again")
    assert run_serial(config).resolve() == folder.resolve()
    assert (folder / "summary.json").is_file() and not lock_path(folder).exists()
    with FolderLock(folder):  # and a live holder in this process blocks another lock of it
        with pytest.raises(ConfigError, match="in use by a live run"):
            FolderLock(folder).acquire()


# ------------------------------------------------------------------------------------------------ resume on other data
def _interrupted_after_round_two(tmp_path):
    """A checkpointed run with client state, SIGKILLed in round 3 (in another process): its checkpoint is round 2's."""
    import signal

    from test_checkpoint_resume import run_killed

    config = tiny_run_config(
        tmp_path,
        users_per_node=4,
        num_server_rounds=4,
        eval_every=2,
        fraction_train=0.5,
        checkpoint_every=2,
        client_state_dir=str(tmp_path / "device"),
        run_name="edited",
    )
    done = run_killed(config, 3)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    return config, tmp_path / "results" / "edited"


def test_a_resume_on_changed_data_is_refused_before_training_naming_both_checksums(tmp_path, capsys, task_identity):
    """Interrupt after round 2, edit the CSV, resume: a same-shape edit trained silently on the new data (config.json
    then recorded the new checksum as if the run had used it throughout), one added user gave a raw IndexError. Both
    are refused now, naming both checksums: by run_serial and the launcher before anything starts, and by the
    ServerApp of a plain ``flwr run`` from what the nodes report, before any training message."""
    import hashlib
    import re

    from flwr.app import Context, RecordDict

    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.app.server_app import main
    from fedrec_flwr.serial import SerialGrid, run_serial
    from fedrec_flwr.state.checkpoint import load_checkpoint

    config, folder = _interrupted_after_round_two(tmp_path)
    import json

    assert load_checkpoint(folder).server_round == 2
    sha = json.loads((folder / "config.json").read_text())["split"]["source-sha256"]
    csv = Path(config["generic-file"])
    original = csv.read_text()
    lines = original.splitlines()
    same_shape = "\n".join(lines[:2] + [re.sub(r",\d+$", ",5000", lines[2])] + lines[3:]) + "\n"
    added_user = original + "".join(f"u24,i{3 * k},5,{1000 + k}\n" for k in range(12))
    resume = {**config, "resume-from": str(folder)}
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    for edited in (same_shape, added_user):
        csv.write_text(edited)
        with pytest.raises(ConfigError) as caught:
            run_serial(resume)
        message = str(caught.value)
        assert "\n" not in message and sha in message, message
        assert "source-sha256" in message and "-> " in message, message
        code, err = _launch(capsys, tmp_path, *_pairs(resume))
        assert code == 2 and len(err) == 1 and sha in err[0], err
        nodes = -(-(24 + (edited is added_user)) // 4)
        grid = SerialGrid(make_client_app(resume), nodes, resume)
        context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=resume)
        with pytest.raises(ConfigError, match=f"source-sha256 {sha} in the checkpoint"):
            main(grid, context, resume)
        assert grid.messages_delivered == nodes  # the identify query only
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()} == before
    csv.write_text(original)  # the data it started with: the run goes on
    assert run_serial(resume) == folder and (folder / "summary.json").is_file()


# ------------------------------------------------------------------------------------------------ debris of faults
KILLED_WRITER = """
import os, signal, sys
from fedrec_flwr import io
os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # killed between writing and renaming
io.atomic_write_bytes(sys.argv[1], b"half")
"""


def _killed_writer(path: Path) -> None:
    """Leave what a writer SIGKILLed mid-write of ``path`` leaves (in another process)."""
    import subprocess
    import sys

    from conftest import PROJECT_ROOT

    done = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(path)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(PROJECT_ROOT)},
    )
    assert done.returncode == -9, done.stderr


def test_a_dead_writers_temporary_files_are_removed_at_the_next_start_and_only_those(tmp_path):
    """Each node's resume check removes the temporary files a killed writer left of its users' state files; a live
    writer's, another user's, and any other file stay."""
    import subprocess
    import sys

    from fedrec_flwr.io import TEMPORARY
    from fedrec_flwr.state.client_state import ClientStateStore

    folder = tmp_path / "device" / "run"
    for user in (3, 5):
        _killed_writer(folder / f"user-{user}.npz")
    assert len(list(folder.glob(".user-3.npz.*.tmp"))) == 1
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = next(folder.glob(".user-3.npz.*.tmp")).name
        alive = folder / dead.replace(f"-{TEMPORARY.fullmatch(dead)['pid']}.", f"-{live.pid}.")
        alive.write_bytes(b"")
        (folder / ".notes.tmp").write_bytes(b"")
        ClientStateStore(folder).resume_problems([3, 4], resume_round=1)
        left = sorted(p.name for p in folder.iterdir())
    finally:
        live.kill()
        live.wait()
    assert not (folder / dead).exists()
    assert alive.name in left and ".notes.tmp" in left and any(n.startswith(".user-5.npz.") for n in left), left


def test_a_resumed_run_leaves_no_temporary_file_of_the_killed_one(tmp_path):
    """SIGKILL mid-write left ``.user-N.npz.*.tmp`` (and ``.metrics.csv.*.tmp``) that nothing cleaned up; the resumed
    run removes them (the results folder's under its lock, the state folder's on each node's resume check)."""
    from fedrec_flwr.serial import run_serial

    config, folder = _interrupted_after_round_two(tmp_path)
    _killed_writer(folder / "metrics.csv")
    _killed_writer(tmp_path / "device" / "edited" / "user-3.npz")
    assert len(list(tmp_path.rglob("*.tmp"))) == 2
    assert run_serial({**config, "resume-from": str(folder)}) == folder
    assert list(tmp_path.rglob("*.tmp")) == [] and (folder / "summary.json").is_file()


def test_a_write_error_names_the_file_being_written(tmp_path, monkeypatch):
    """A full disk gave ``[Errno 28] No space left on device`` without the file; the error names it, and the
    temporary file is gone."""
    import errno

    from fedrec_flwr import io as fio
    from fedrec_flwr.state.results import RunRecorder

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    recorder = RunRecorder(tmp_path / "run", {}, {})
    monkeypatch.setattr(fio.os, "fsync", full)
    with pytest.raises(OSError) as caught:
        recorder.record(1, {"train-loss": 0.5}, {})
    assert caught.value.errno == errno.ENOSPC and str(tmp_path / "run" / "metrics.csv") in str(caught.value)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["config.json"]


# ------------------------------------------------------------------------------------------------ one line each
def test_a_path_with_a_newline_is_one_console_line_and_one_refusal_line(tmp_path, capsys):
    """The quiet console keeps a record's first line: with a newline in the results folder's path, the console said
    ``results in /.../res`` and ``results written to /.../res``. Each record is one line now, the path escaped; and a
    refusal naming such a path is one line too (run_serial and the launcher)."""
    import io

    from fedrec_flwr.app.server_app import _setup_logging
    from fedrec_flwr.serial import run_serial

    logging.getLogger("flwr").setLevel(logging.WARNING)
    results = tmp_path / "res\nults"
    config = tiny_run_config(
        tmp_path, users_per_node=USERS_PER_NODE, num_server_rounds=1, run_name="nl", results_dir=str(results)
    )
    _setup_logging()
    handlers = logging.getLogger("fedrec_flwr").handlers
    stream = io.StringIO()
    previous = [h.setStream(stream) for h in handlers]
    try:
        folder = run_serial(config)
    finally:
        for handler, old in zip(handlers, previous):
            handler.setStream(old)
    shown = repr(str(folder))[1:-1]
    lines = stream.getvalue().splitlines()
    assert any(line.endswith(f"results in {shown}") for line in lines), lines
    assert any(line.endswith(f"results written to {shown}") for line in lines), lines
    assert all(line.startswith(("INFO ", "WARNING ", "ERROR ", "round ")) for line in lines), lines

    with pytest.raises(ConfigError) as caught:  # a finished run's folder: refused, in one line
        run_serial(config)
    assert "\n" not in str(caught.value) and shown in str(caught.value)
    code, err = _launch(capsys, tmp_path, *_pairs(config))
    assert code == 2 and len(err) == 1 and shown in err[0], err


def test_a_raw_newline_inside_balanced_quotes_gets_its_own_hint():
    """``run-name="a<newline>b"`` was refused as "an unbalanced quote?" although the quotes balance."""
    with pytest.raises(ConfigError) as caught:
        launch.parse_override('run-name="a\nb"')
    message = str(caught.value)
    assert "unbalanced" not in message and "raw control character '\\n'" in message and "\n" not in message, message
    assert 'run-name="a\\u000Ab"' in message
    with pytest.raises(ConfigError, match="an unbalanced quote"):
        launch.parse_override('run-name="ab')


# ------------------------------------------------------------------------------------------------ non-finite state
def test_a_resume_from_a_client_state_file_holding_nan_is_refused_naming_it(tmp_path):
    """The resume check rejected only unreadable files: a state file holding NaN was resumed from, and its user's
    node failed every round it was sampled. Now it is refused like a damaged file, naming it."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, RecordDict

    from fedrec_flwr.state.client_state import ClientStateStore

    store = ClientStateStore(tmp_path / "device" / "run")
    for user, value in ((0, np.nan), (1, 1.0), (2, np.inf)):
        state = RecordDict({f"user:{user}": ArrayRecord({"w": Array(np.array([value, 0.0], dtype=np.float32))})})
        store.save(user, state, 1, durable_round=1)
    later = RecordDict({"user:1": ArrayRecord({"w": Array(np.array([np.nan], dtype=np.float32))})})
    store.save(1, later, 3, durable_round=1)  # a version after the checkpoint is never resumed from
    damaged, absent = store.resume_problems([0, 1, 2, 3], resume_round=2)
    assert damaged == [0, 2] and absent == [3]


# ------------------------------------------------------------------------------------------------ the launcher
@pytest.mark.parametrize(
    "spec, guess",
    [
        ("FedAdam", "flwr.serverapp.strategy:FedAdam"),
        ("fedprox", "flwr.serverapp.strategy:FedProx"),
        ("item-fedavgg", "item-fedavg"),
        ("flwr.serverapp.strategy:FedAdamm", "flwr.serverapp.strategy:FedAdam"),
    ],
)
def test_an_unknown_strategy_name_points_to_the_closest_one_flowers_too(tmp_path, capsys, spec, guess):
    mapping = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, strategy=spec)
    code, lines = _launch(capsys, tmp_path, *_pairs(mapping))
    assert code == 2 and len(lines) == 1 and f"did you mean {guess!r}?" in lines[0], lines


def _deploy_local():
    import importlib.util

    from conftest import PROJECT_ROOT

    spec = importlib.util.spec_from_file_location(
        "deploy_local_under_test", PROJECT_ROOT / "scripts" / "deploy_local.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deploy_local_passes_a_relative_data_dir_on_as_an_absolute_one(tmp_path, monkeypatch, capsys, ml100k_dir):
    """``FEDREC_DATA_DIR=../shared/data scripts/deploy_local.py`` (relative, as the README writes it elsewhere) failed
    after 44 s: the SuperNodes read it from another folder. It is made absolute against the caller's folder before
    anything starts (the processes inherit it), and a relative one that names no folder is refused then: exit 2."""
    module = _deploy_local()
    seen = {}

    class Started(Exception):
        pass

    class FakeDeployment:
        def __init__(self, *args, **kwargs):
            seen["FEDREC_DATA_DIR"] = __import__("os").environ.get("FEDREC_DATA_DIR")
            raise Started

    monkeypatch.setattr(module, "Deployment", FakeDeployment)
    (tmp_path / "data").symlink_to(ml100k_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDREC_DATA_DIR", "data")
    with pytest.raises(Started):
        module.main(["users-per-node=472", f"cache-dir={tmp_path / 'cache'}", "--workdir", str(tmp_path / "work")])
    assert seen["FEDREC_DATA_DIR"] == str((tmp_path / "data").resolve())

    capsys.readouterr()
    monkeypatch.setenv("FEDREC_DATA_DIR", "../nowhere")
    code = module.main(["users-per-node=472", "--workdir", str(tmp_path / "work2")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "$FEDREC_DATA_DIR = '../nowhere': no such folder" in lines[-1], lines
    assert not (tmp_path / "work2").exists()


def test_the_supernode_wrapper_finds_flowers_executables_without_the_venv_on_path(tmp_path, monkeypatch):
    """``flower-supernode`` starts ``flwr-clientapp`` by name: without the virtual environment on PATH it crashed with
    FileNotFoundError. The wrapper puts this environment's console scripts first on PATH."""
    import sys

    from fedrec_flwr.launch import supernode

    started = {}
    monkeypatch.setattr(supernode, "check_superlink_listening", lambda address, timeout: None)
    monkeypatch.setattr(supernode.os, "execve", lambda path, argv, env: started.update(env=env))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert (
        supernode.supernode_main(
            ["--partition-id", "0", "--num-partitions", "3", "--superlink", "127.0.0.1:1", "--insecure"]
        )
        == 0
    )
    assert started["env"]["PATH"].split(":")[0] == str(Path(sys.executable).parent)


FAKE_SUPERLINK = """
import subprocess, sys, time
if len(sys.argv) > 4 and sys.argv[4] == "busy":  # a run in progress: the SuperLink's child flwr-simulation
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "flwr-simulation"])
time.sleep(120)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_stop_finds_the_superlink_a_plain_flwr_run_left_in_its_home(tmp_path, capsys):
    """A plain ``flwr run`` that failed leaves Flower's detached local SuperLink (``--database <home>/local-superlink
    /state.db``); ``launch stop --flwr-home`` said "no SuperLink of an earlier run is left" while it ran. It stops it
    now (its command line proves the home), and leaves one under which a run is in progress, saying so."""
    import subprocess
    import sys
    import time

    home = tmp_path / "home"
    (home / "local-superlink").mkdir(parents=True)
    other = tmp_path / "other"

    def superlink(flwr_home, *extra):
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                FAKE_SUPERLINK,
                "flower-superlink",
                "--database",
                str(flwr_home / "local-superlink" / "state.db"),
                *extra,
            ],
            start_new_session=True,
        )

    left, foreign = superlink(home), superlink(other)
    try:
        time.sleep(0.5)
        assert launch.main(["stop", "--flwr-home", str(home)]) == 0
        out = capsys.readouterr().out
        assert left.wait(timeout=30) is not None and f"{left.pid}" in out, out
        assert foreign.poll() is None, "another home's SuperLink is not touched"
        busy = superlink(home, "busy")
        time.sleep(1.0)
        assert launch.main(["stop", "--flwr-home", str(home)]) == 0
        out = capsys.readouterr().out
        assert busy.poll() is None and "a run is in progress" in out and f"pid {busy.pid}" in out, out
    finally:
        for process in (left, foreign, locals().get("busy")):
            if process is not None and process.poll() is None:
                import os
                import signal

                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_a_new_run_refuses_a_clients_state_folder_an_earlier_run_of_its_name_left(tmp_path):
    """The clients' state folder is named after the run only: a second run of the same name in another results-dir
    (or after a failed one) loaded the earlier run's private state as its own (evaluation, and training of a user
    first sampled later). Each node now reports such files at identify time, and the run is refused before round 1
    naming the folder; the earlier files are untouched."""
    import hashlib

    from fedrec_flwr.serial import run_serial

    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = tiny_run_config(
        tmp_path,
        users_per_node=USERS_PER_NODE,
        num_server_rounds=1,
        run_name="same",
        client_state_dir=str(tmp_path / "device"),
    )
    run_serial(config)
    state = tmp_path / "device" / "same"
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in state.iterdir()}
    assert before
    with pytest.raises(
        ConfigError,
        match=r"run-config key 'run-name' = 'same': the clients' state folder "
        rf"'{state}' .* already holds state files of an earlier run of this name",
    ):
        run_serial({**config, "results-dir": str(tmp_path / "elsewhere")})
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in state.iterdir()} == before
    assert not (tmp_path / "elsewhere" / "same").exists()


@pytest.mark.parametrize("block_training", ["on", "off"])
def test_one_users_nonfinite_state_leaves_that_user_out_and_its_nodes_other_users_go_on(tmp_path, block_training):
    """With users-per-node = 4, user 0's private record set to inf after round 1 took its whole node out for good
    (users 1-3 never trained or evaluated again, one warning a round; the per-user path's error named no user). Now
    user 0 is named in its node's log and left out, counted in summary.json, and the node's other users go on."""
    import json

    import numpy as np
    from flwr.app import Array, ArrayRecord

    from fedrec_flwr.serial import run_serial

    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = tiny_run_config(
        tmp_path,
        users_per_node=4,
        num_server_rounds=3,
        fraction_train=1.0,
        run_name="inf",
        block_training=block_training,
    )

    def poison(view):
        if view.server_round == 1:
            context = next(c for c in view.grid.contexts.values() if c.node_config["partition-id"] == 0)
            context.state["user:0"] = ArrayRecord(
                {k: Array(np.full_like(v.numpy(), np.inf)) for k, v in context.state["user:0"].items()}
            )

    import io

    seen = logging.StreamHandler(io.StringIO())
    logging.getLogger("fedrec_flwr.app.handler_common").addHandler(seen)
    try:
        folder = run_serial(config, on_round=poison)
    finally:
        logging.getLogger("fedrec_flwr.app.handler_common").removeHandler(seen)
    summary = json.loads((folder / "summary.json").read_text())
    rows = json.loads((folder / "metrics.json").read_text())
    assert summary["client-failures"] == {} and summary["evaluation-failures"] == {}, summary
    assert summary["isolated-users"] == {"train": {"2": 1, "3": 1}, "evaluate": {"2": 1, "3": 1}}, summary
    assert [r["train-users"] for r in rows] == [24, 23, 23] and [r["eval-users"] for r in rows] == [24, 23, 23]
    assert "user 0: private state user:0/" in seen.stream.getvalue()


def test_a_user_whose_training_diverges_on_the_per_user_path_is_named(tmp_path, monkeypatch, task_identity):
    """The block path's FloatingPointError names its users; the per-user path's named the epoch and step only."""
    from fedrec_flwr.app import client_app
    from fedrec_flwr.serial import SerialGrid

    mapping = tiny_run_config(tmp_path, users_per_node=USERS_PER_NODE, block_training="off")
    cls = client_app.resolve("client", mapping["client"])

    def diverge(self, shared, config):
        raise FloatingPointError("non-finite loss at epoch 1, step 1")

    monkeypatch.setattr(cls, "fit_named", diverge)
    runtime = client_app.get_runtime(mapping)
    grid = SerialGrid(client_app.make_client_app(mapping), 4, mapping)
    context = next(iter(grid.contexts.values()))
    with pytest.raises(FloatingPointError, match=r"^user 0: non-finite loss at epoch 1"):
        list(client_app._user_updates(runtime, [0, 1], context, {}, {}))
