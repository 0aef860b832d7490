"""The launcher's command line (``python -m fedrec_flwr.launch``): ``run`` starts a run
(:func:`~fedrec_flwr.launch.flwr_run.flwr_run`), ``stop`` ends what a killed launcher left; a usage or config error
is one ``error:`` line and exit 2, a signal exits 128 + its number.

Command line::

    python -m fedrec_flwr.launch run [--num-supernodes N] [--flwr-home DIR] [--ray-address HOST:PORT]
                                     [--federation-config KEY=VALUE ...] [--timeout SECONDS] [--verbose] [--debug]
                                     [key=value ...]
    python -m fedrec_flwr.launch stop [--flwr-home DIR]

``key=value`` pairs are run-config overrides; flags may come before, between or after them. Values are TOML
(``num-server-rounds=20``, ``fraction-train=0.5``, ``dataset='filmtrust'``); a key whose default is a string also
takes the bare text (``dataset=filmtrust``, ``data-dir=/data/o'brien/ml-100k``), passed on exactly. Spaces around
``=`` and around the value are dropped (``"model = ncf"``); to keep them, quote the value (``run-name=" a "``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from fedrec_flwr.errors import FedRecError
from fedrec_flwr.launch.env import absolute_path_env
from fedrec_flwr.launch.flwr_run import flwr_run
from fedrec_flwr.launch.overrides import parse_run_options
from fedrec_flwr.launch.processes import raise_stopped
from fedrec_flwr.launch.superlink import stop_main


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of ``run`` or ``stop``."""
    prog = f"python -m fedrec_flwr.launch {command}"
    if command == "stop":
        stop = argparse.ArgumentParser(
            prog=prog,
            allow_abbrev=False,
            description="stop SuperLinks left by launchers that were killed (never a running run)",
        )
        stop.add_argument("--flwr-home", default=None, help="Flower home (default $FLWR_HOME, else ~/.flwr)")
        return stop
    run = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,  # --verbos is refused, not read as --verbose
        description="flwr run the app on a fresh local SuperLink, then stop it. "
        "Flags may come anywhere among the key=value overrides.",
    )
    run.add_argument(
        "--num-supernodes",
        type=int,
        default=None,
        help="simulated SuperNodes (default: ceil(users / users-per-node); another number is refused)",
    )
    run.add_argument("--flwr-home", default=None, help="Flower home (default $FLWR_HOME, else ~/.flwr)")
    run.add_argument(
        "--ray-address",
        default=None,
        help="host:port of an existing Ray cluster's head (ray start --head) to run the client actors on",
    )
    run.add_argument(
        "--federation-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another flwr simulation-config key, e.g. client-resources-num-cpus=1 (repeatable)",
    )
    run.add_argument(
        "--timeout",
        default=None,
        metavar="SECONDS",  # checked in parse_args: one error line
        help="stop the run SECONDS after flwr run starts (exit 124), naming what was still running",
    )
    run.add_argument(
        "--verbose",
        action="store_true",
        help="print Flower's whole log (default: progress, warnings, "
        "errors; the whole log is always in <FLWR_HOME>/logs/)",
    )
    run.add_argument("--debug", action="store_true", help="print tracebacks of errors caught before the run starts")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="run-config overrides")
    return run


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, dict[str, Any], dict[str, Any]]:
    """The parsed command line, the run-config overrides and the federation config (flags anywhere).

    Raises:
        ConfigError: a malformed override (see :func:`~fedrec_flwr.launch.overrides.parse_override`).
        SystemExit: no or an unknown command, ``--help``, or a bad flag (argparse's message, status 2).
    """
    argv = list(argv)
    if not argv or argv[0] not in ("run", "stop"):
        print(__doc__.split("Command line::")[1].split("``key=value``")[0].strip("\n"), file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    args = build_parser(argv[0]).parse_intermixed_args(argv[1:])
    args.command = argv[0]
    if args.command != "run":
        return args, {}, {}
    args.timeout, overrides, federation = parse_run_options(args.overrides, args.federation_config, args.timeout)
    return args, overrides, federation


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def command() -> int:
        args, overrides, federation = parse_args(argv)
        if args.command == "stop":
            return stop_main(args.flwr_home)
        absolute_path_env()
        result = flwr_run(
            overrides,
            num_supernodes=args.num_supernodes,
            flwr_home=args.flwr_home,
            federation_config=federation,
            ray_address=args.ray_address,
            verbose=args.verbose,
            timeout=args.timeout,
        )
        return result.returncode

    return guarded(command, debug="--debug" in argv)


def guarded(command: Callable[[], int], debug: bool = False) -> int:
    """Run ``command`` as the command line does and return its exit status: SIGTERM / SIGHUP end it like Ctrl-C
    (128 + the signal's number, after one line saying what was stopped), and a :class:`FedRecError` is one
    ``error:`` line on stderr and status 2 (``debug``: its traceback first)."""
    previous = {sig: signal.signal(sig, raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return command()
    except KeyboardInterrupt as stop:
        print(
            f"\nstopped ({stop.args[0] if stop.args else 'Ctrl-C'}): the run, its SuperLink and Ray were ended",
            file=sys.stderr,
        )
        return stop.args[1] if len(stop.args) > 1 else 128 + signal.SIGINT
    except FedRecError as err:
        if debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
