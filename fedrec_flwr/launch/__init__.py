"""Run the app with ``flwr run`` on a local SuperLink that this launcher starts, owns and stops.

``flwr run .`` (flwr 1.42) starts a *detached* local SuperLink that outlives the command, on fixed ports (39091 unless
``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` says otherwise), and by default installs the app's dependencies with ``uv`` at
run time. This module wraps it so a run is self-contained and never touches what it did not start:

* the launcher starts the local SuperLink itself, in its own session, on free ports (or the ports the two
  ``FLWR_LOCAL_*`` variables name), with an in-memory database; ``flwr run`` finds it there and uses it;
* every process the run starts carries a fresh per-run token in its environment (:data:`TOKEN_ENV`), so the
  SuperLink's process group, the simulation, and Ray daemons that left the group are found and ended afterwards --
  and nothing else: never a process that merely shares ``FLWR_HOME``, never an ancestor of the launcher;
* two runs in one checkout run side by side: a launcher holds a lock on its Flower home, and a second launcher
  takes the next free home ``<FLWR_HOME>/concurrent-<i>`` (Flower installs apps there without a lock, so two runs
  must not share one) and its own ports, and says so;
* a SuperLink left behind by a launcher that was killed (``kill -9``) is recorded in its home
  (``local-superlink/fedrec-launch.json``: PID, start time, token) and stopped by the next run or by ``stop``;
* runtime dependency installation is off (``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``);
* ``num-supernodes`` is computed from the dataset's users and ``users-per-node`` unless given, and a given number
  that does not match is refused before anything starts;
* every check that needs no Flower (:func:`fedrec_flwr.app.preflight.preflight`, with the data: keys, plug-ins, the
  dataset, attributes, ``forget-users``, ``resume-from``, the results folder, a Flower strategy's config keys) runs
  before anything starts: one ``error:`` line, exit 2, nothing created; so do the command line's own checks (a key
  given twice, ``--federation-config`` keys and values as ``flwr run`` checks them) and an unusable Flower home;
* the exit status is 0 only when Flower reports the run ``finished:completed``, 1 for a run that started and failed
  (its own error is the last line printed), 2 for a usage or config error found before the start;
* a run whose simulation does not exit :data:`END_GRACE` s after its ServerApp's last line (a ClientApp that never
  returns keeps Flower 1.42's simulation waiting, and ``flwr run`` with it) is stopped: exit 1, with the nodes that
  gave no reply and their rounds; ``--timeout SECONDS`` stops the whole run after SECONDS: exit 124, likewise;
* Ctrl-C (or SIGTERM / SIGHUP) stops the run, its SuperLink and Ray, and exits 128 + the signal's number, as a
  shell reports a process a signal ended: 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP).

Modules: :mod:`~fedrec_flwr.launch.flwr_run` (the run), :mod:`~fedrec_flwr.launch.superlink` (the local SuperLink,
Flower homes, ``stop``), :mod:`~fedrec_flwr.launch.processes` (finding and ending processes, signals),
:mod:`~fedrec_flwr.launch.overrides` (run-config overrides), :mod:`~fedrec_flwr.launch.checks` (checks before the
start), :mod:`~fedrec_flwr.launch.output` (the log), :mod:`~fedrec_flwr.launch.env` (the environment) and
:mod:`~fedrec_flwr.launch.cli` (``python -m fedrec_flwr.launch``). The deployed runtime (real SuperLink and SuperNode
processes) is :mod:`fedrec_flwr.launch.deploy`, with :mod:`~fedrec_flwr.launch.supernode` and
:mod:`~fedrec_flwr.launch.tls`; it is not imported here, so that ``python -m fedrec_flwr.launch.deploy`` runs it as a
script.
"""

from fedrec_flwr.launch.checks import (
    RAY_CONNECT_TIMEOUT,
    check_ray_address,
    check_run,
    check_shipped,
    num_supernodes_for,
    shipped_files,
)
from fedrec_flwr.launch.cli import build_parser, guarded, main, parse_args
from fedrec_flwr.launch.env import (
    PATH_ENV,
    PROJECT_ROOT,
    RAY_INLINE_BYTES,
    RAY_INLINE_ENV,
    absolute_path_env,
    console_script,
    default_home,
    flwr_env,
)
from fedrec_flwr.launch.flwr_run import END_GRACE, flwr_run, run_status
from fedrec_flwr.launch.output import (
    ANSI,
    ERROR_LINE,
    NO_REPLY,
    QUIET_HIDDEN,
    SERVERAPP_ENDED,
    pump_output,
    run_error,
    shown_quietly,
    still_running,
)
from fedrec_flwr.launch.overrides import (
    FEDERATION_KEYS,
    check_federation_config,
    parse_override,
    parse_run_options,
    run_config_args,
    toml_value,
)
from fedrec_flwr.launch.processes import (
    TOKEN_ENV,
    Stopped,
    alive,
    ancestors,
    end_processes,
    group_members,
    processes_with_env,
    raise_stopped,
    run_processes,
    start_time,
    terminate,
)
from fedrec_flwr.launch.superlink import (
    FLOWER_RUN_PROCESSES,
    LOCK_FILE,
    MAX_CONCURRENT,
    RECORD_FILE,
    HomeBusy,
    LocalSuperLink,
    claim_home,
    flower_superlinks,
    free_port,
    stop_main,
    stop_recorded_superlink,
    superlink_pids,
)

__all__ = [
    "ANSI",
    "END_GRACE",
    "ERROR_LINE",
    "FEDERATION_KEYS",
    "FLOWER_RUN_PROCESSES",
    "HomeBusy",
    "LOCK_FILE",
    "LocalSuperLink",
    "MAX_CONCURRENT",
    "NO_REPLY",
    "PATH_ENV",
    "PROJECT_ROOT",
    "QUIET_HIDDEN",
    "RAY_CONNECT_TIMEOUT",
    "RAY_INLINE_BYTES",
    "RAY_INLINE_ENV",
    "RECORD_FILE",
    "SERVERAPP_ENDED",
    "Stopped",
    "TOKEN_ENV",
    "absolute_path_env",
    "alive",
    "ancestors",
    "build_parser",
    "check_federation_config",
    "check_ray_address",
    "check_run",
    "check_shipped",
    "claim_home",
    "console_script",
    "default_home",
    "end_processes",
    "flower_superlinks",
    "flwr_env",
    "flwr_run",
    "free_port",
    "group_members",
    "guarded",
    "main",
    "num_supernodes_for",
    "parse_args",
    "parse_override",
    "parse_run_options",
    "processes_with_env",
    "pump_output",
    "raise_stopped",
    "run_config_args",
    "run_error",
    "run_processes",
    "run_status",
    "shipped_files",
    "shown_quietly",
    "start_time",
    "still_running",
    "stop_main",
    "stop_recorded_superlink",
    "superlink_pids",
    "terminate",
    "toml_value",
]
