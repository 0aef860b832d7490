"""The launcher's environment: the Flower app folder, the environment ``flwr run`` and every process it starts
get, the default Flower home, this environment's console scripts, and folder variables made absolute."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from fedrec_flwr.config import app_root
from fedrec_flwr.errors import ConfigError, FedRecError
from fedrec_flwr.state.results import SOURCE_COMMIT_ENV, source_commit


def _project_root() -> Path:
    """:func:`~fedrec_flwr.config.app_root`, or the folder above the package when there is none (every use of the
    defaults then raises :class:`~fedrec_flwr.errors.ConfigError` from :func:`~fedrec_flwr.config.default_mapping`)."""
    try:
        return app_root()
    except ConfigError:
        return Path(__file__).resolve().parents[2]


PROJECT_ROOT = _project_root()
"""The Flower app folder that ``flwr run`` is given: the source checkout, or the installed copy of the app."""


RAY_INLINE_ENV = "RAY_max_direct_call_object_size"
RAY_INLINE_BYTES = 1 << 20
"""Bytes up to which Ray passes a message to a client actor and its reply back inside its own RPC messages instead of
its shared-memory object store (Ray's default: 100 KiB); :func:`flwr_env` sets it for ``flwr run`` (1 MiB: the
ML-100K model, 0.44 MB, and every one-user reply fit; larger models still take the object store)."""


def flwr_env(flwr_home: str | os.PathLike | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for ``flwr run``: no runtime dependency installation, no Ray accelerator warning, and Ray's
    task events off (``RAY_task_events_report_interval_ms=0``, unless set): Ray's GCS otherwise keeps a record of
    every actor call, up to 100,000 of them, for its dashboard's task list; one per message here, so the simulation's
    memory grew about 2 MiB a round on Amazon-Video at 10 users per node (``experiments/bench/soak.py``). Set the
    variable to Ray's default ``1000`` to have the task list back.

    Also glibc's ``MALLOC_ARENA_MAX=2`` (unless set): Flower's simulation process runs many threads, each of which may
    get a malloc arena of its own (up to 8 per core), and an evaluation round's extra messages left a high-water mark
    in them (+7 to +60 MiB at round 10 in three Amazon-Video soaks, simulation process and actors). With two arenas
    the step at round 10 was +2.5 MiB and the round times unchanged (one 20-round soak,
    ``experiments/bench/README.md``). Set the variable yourself to override it.

    And Ray's inline-object limit ``RAY_max_direct_call_object_size`` raised to :data:`RAY_INLINE_BYTES` (unless
    set): Ray returns a task's result and passes its arguments inside its own RPC messages only up to 100 KiB by
    default, and moves anything larger through its shared-memory object store, which cost several milliseconds of the
    simulation's two-core budget per message: on ML-100K every train and evaluate message carries the 0.44 MB model
    and a one-user train reply is 104-116 KB. Measured on Flower's simulation engine (``bench_simulation.py``, 100 of
    943 one-user nodes): a bare app sending the model took 1.22-1.26 s per round with Ray's default, 0.64 s with
    1 MiB; the same bare app replying with 110 KB took 1.81-1.95 s against 0.65 s. Transport only: no result
    changes. Set the variable yourself to override it."""
    env = dict(os.environ)
    # flwr starts `flower-superlink` and `flwr-simulation` by name: they live beside this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    env.setdefault("RAY_task_events_report_interval_ms", "0")
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env.setdefault(RAY_INLINE_ENV, str(RAY_INLINE_BYTES))
    env.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    if flwr_home:
        env["FLWR_HOME"] = str(flwr_home)
    commit = source_commit(PROJECT_ROOT)  # config.json's "produced-by": the ServerApp runs from the unpacked FAB
    if commit:
        env[SOURCE_COMMIT_ENV] = commit
    env.update(extra or {})
    return env


def default_home(env: Mapping[str, str] | None = None) -> Path:
    """``$FLWR_HOME``, else ``~/.flwr`` (Flower's default), as an absolute path."""
    env = os.environ if env is None else env
    return Path(env.get("FLWR_HOME") or Path.home() / ".flwr").expanduser().resolve()


def console_script(name: str) -> str:
    """A console script of this environment (beside the interpreter: ``flwr``, ``flower-superlink``, ...)."""
    return str(Path(sys.executable).with_name(name))


PATH_ENV = ("FEDREC_DATA_DIR", "FEDREC_FLWR_CACHE")
"""Environment variables naming a folder that the ClientApps read (:data:`fedrec_flwr.app.runtime.DATA_DIR_ENV`, the
split cache): made absolute against the caller's working folder before anything starts, as the processes started
later inherit them and may run in another folder (a SuperNode's, Ray's)."""


def absolute_path_env(env: dict | None = None) -> dict[str, str]:
    """Make each set variable of :data:`PATH_ENV` in ``env`` (default ``os.environ``, which the processes started
    later inherit) absolute, against this process's working folder; returns what was changed.

    Raises:
        FedRecError: ``FEDREC_DATA_DIR`` names no folder (the message gives the value and the folder it was resolved
            against), before anything starts.
    """
    env = os.environ if env is None else env
    changed = {}
    for name in PATH_ENV:
        value = env.get(name)
        if not value:
            continue
        path = Path(value).expanduser().resolve()
        if name == "FEDREC_DATA_DIR" and not path.is_dir():
            raise FedRecError(
                f"${name} = {value!r}: no such folder ({path}, resolved against the working folder {os.getcwd()})"
            )
        if str(path) != value:
            env[name] = changed[name] = str(path)
    return changed
