#!/usr/bin/env python
"""Run the app end to end on a real Flower deployment on this machine, then report wall time per round.

Starts one ``flower-superlink`` and N ``flower-supernode`` processes on 127.0.0.1 (free ports; optionally TLS and
SuperNode authentication), submits the app with ``flwr run <app> <connection> --stream``, waits for the results
folder, ends every process it started, and prints each round's wall time (``metrics.csv``: ``seconds``, the
round's wall time; ``train-seconds``, its training part) and the final HR@10 / NDCG@10
(HR@K / NDCG@K, K the first of ``ks``, when ``ks`` has no 10).

Usage::

    python scripts/deploy_local.py --supernodes 3 [--tls] [--auth] [--snapshot] [--workdir DIR] [--json FILE] \\
        [key=value ...]

``key=value`` pairs are run-config overrides, read as ``python -m fedrec_flwr.launch run`` reads them (TOML values;
a key whose default is a string also takes bare text, e.g. ``model=mf``), in any order with the flags. Without
``users-per-node``, it is ``ceil(users / supernodes)``; with it, ``--supernodes`` may be left out. Relative
paths (``data-dir``, ``cache-dir``, ``results-dir``, ``resume-from``, ``client-state-dir``, the generic files, and
``$FEDREC_DATA_DIR`` / ``$FEDREC_FLWR_CACHE``) are made absolute against the caller's working folder, and a
``$FEDREC_DATA_DIR`` that names no folder is refused, before anything starts (the ServerApp and ClientApps run
elsewhere);
``results-dir`` defaults to ``<workdir>/results``. Logs of every process stay in ``<workdir>/logs``.

Example (MovieLens-100K, 10 SuperNodes of 95 users, 5 rounds, TLS and authentication)::

    FEDREC_DATA_DIR=/path/to/data python scripts/deploy_local.py --supernodes 10 --tls --auth \\
        num-server-rounds=5 eval-every=5 model=mf

Run outside the checkout's virtual environment (``python scripts/deploy_local.py``), it runs itself again with
``.venv/bin/python``. The exit status is 0 only when the run wrote its results; otherwise the run's own error is the
last line printed (``--debug`` also prints the traceback of an error caught before the run): 2 for bad input refused
before any process starts, 1 for a run that failed, 128 + the signal's number when Ctrl-C (130), SIGTERM (143) or
SIGHUP (129) stopped it, after every process it started was ended.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
try:
    import pandas  # noqa: F401 - a dependency only the package's environment has
except ImportError:
    if VENV_PYTHON.is_file() and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), *sys.argv])
    raise SystemExit(
        "error: fedrec-flwr is not installed here: run `bash experiments/quickstart.sh` once (it makes "
        ".venv), or call this script with the Python that has it"
    ) from None
sys.path.insert(0, str(ROOT))

from fedrec_flwr.errors import FedRecError  # noqa: E402
from fedrec_flwr.launch import (  # noqa: E402
    absolute_path_env,  # noqa: E402
    parse_override,
    raise_stopped,
    run_error,
)
from fedrec_flwr.launch.deploy import Deployment, DeploymentError, app_snapshot  # noqa: E402
from fedrec_flwr.state.results import headline_k  # noqa: E402

PATH_KEYS = (
    "data-dir",
    "cache-dir",
    "results-dir",
    "generic-file",
    "generic-attributes-file",
    "resume-from",
    "client-state-dir",
)
"""Run-config keys naming a file or folder: made absolute against the caller's working folder (the ServerApp and the
ClientApps run in other folders)."""


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` words -> overrides (:func:`fedrec_flwr.launch.parse_override`), path keys made absolute.

    Raises:
        ConfigError: a malformed pair (the message names the key and the fix).
    """
    from fedrec_flwr.config import default_mapping

    defaults = default_mapping()
    overrides = dict(parse_override(pair, defaults) for pair in pairs)
    for key in PATH_KEYS:
        if overrides.get(key):
            overrides[key] = str(Path(str(overrides[key])).expanduser().resolve())
    return overrides


def check_flags(args: argparse.Namespace) -> None:
    """Refuse flags that cannot work before anything starts.

    Raises:
        FedRecError: ``--supernodes`` below 1, a ``--timeout`` that is not a positive number of seconds, or a
            ``--json`` file whose folder does not exist or is not writable (the message names the flag and value).
    """
    if args.supernodes is not None and args.supernodes < 1:
        raise FedRecError(f"--supernodes {args.supernodes}: expected at least 1")
    if not args.timeout > 0:
        raise FedRecError(f"--timeout {args.timeout}: expected a positive number of seconds")
    if args.json:
        folder = Path(args.json).expanduser().resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise FedRecError(f"--json {args.json}: folder {folder} does not exist or is not writable")


def plan_nodes(overrides: dict[str, Any], supernodes: int | None) -> int:
    """Number of SuperNodes, and ``users-per-node`` set in ``overrides``, consistent with the dataset's users."""
    from fedrec_flwr.app.runtime import load_split_for
    from fedrec_flwr.config import RunConfig, default_mapping

    mapping = default_mapping()
    mapping.update(overrides)
    if "users-per-node" not in overrides:
        mapping["users-per-node"] = 1
    num_users = load_split_for(RunConfig.from_mapping(mapping)).num_users
    if "users-per-node" in overrides:
        needed = -(-num_users // int(overrides["users-per-node"]))
        if supernodes is not None and supernodes != needed:
            raise FedRecError(
                f"--supernodes {supernodes} does not match users-per-node = {overrides['users-per-node']}: "
                f"{num_users} users need exactly {needed} SuperNodes"
            )
        return needed
    supernodes = 3 if supernodes is None else supernodes
    per_node = -(-num_users // supernodes)
    if -(-num_users // per_node) != supernodes:
        raise FedRecError(
            f"{num_users} users cannot be split into exactly {supernodes} non-empty blocks of equal size "
            f"(users-per-node {per_node} gives {-(-num_users // per_node)} SuperNodes); choose another "
            "--supernodes or set users-per-node"
        )
    overrides["users-per-node"] = per_node
    return supernodes


def report(folder: Path, startup: float, run_seconds: float, supernodes: int) -> dict[str, Any]:
    """Print the per-round table and the final metrics; returns them as a mapping."""
    with open(folder / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    summary = json.loads((folder / "summary.json").read_text())
    k = headline_k(None, rows) or 10  # HR@10 when the run's ks has it, else its first K
    print(f"\n{'round':>5}  {'seconds':>8}  {'train-s':>8}  {f'HR@{k}':>7}  {f'NDCG@{k}':>7}")
    for row in rows:
        hr = f"{float(row[f'HR@{k}']):.4f}" if row.get(f"HR@{k}") else "-"
        ndcg = f"{float(row[f'NDCG@{k}']):.4f}" if row.get(f"NDCG@{k}") else "-"
        print(
            f"{row['round']:>5}  {float(row['seconds']):8.1f}  {float(row.get('train-seconds') or 0):8.1f}  "
            f"{hr:>7}  {ndcg:>7}"
        )
    seconds = [float(r["seconds"]) for r in rows]
    final = summary.get("final", {})
    result = {
        "supernodes": supernodes,
        "rounds": len(rows),
        "round-seconds": seconds,
        "train-seconds": [float(r.get("train-seconds") or 0) for r in rows],
        "mean-round-seconds": sum(seconds) / len(seconds) if seconds else None,
        "startup-seconds": round(startup, 3),
        "run-seconds": round(run_seconds, 3),
        "server-total-seconds": summary.get("total-seconds"),
        f"HR@{k}": final.get(f"HR@{k}"),
        f"NDCG@{k}": final.get(f"NDCG@{k}"),
        "folder": str(folder),
    }
    print(
        f"\n{supernodes} SuperNodes: mean {result['mean-round-seconds']:.1f} s per round over {len(rows)} rounds; "
        f"startup {startup:.1f} s, run {run_seconds:.1f} s (submit to results), ServerApp "
        f"{summary.get('total-seconds')} s"
    )
    print(
        f"final HR@{k} {final.get(f'HR@{k}', float('nan')):.4f}  "
        f"NDCG@{k} {final.get(f'NDCG@{k}', float('nan')):.4f}"
        f"  -> {folder}"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--supernodes", type=int, default=None, help="SuperNodes to start (default 3)")
    parser.add_argument("--tls", action="store_true", help="TLS on the SuperLink (a CA made for this run)")
    parser.add_argument(
        "--auth", action="store_true", help="SuperNode authentication (registered keys only; implies --tls)"
    )
    parser.add_argument("--workdir", default=None, help="folder for FLWR_HOMEs, logs, certificates, keys")
    parser.add_argument(
        "--snapshot", action="store_true", help="flwr run a lean copy of the app (faster FAB build; same code)"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the results")
    parser.add_argument("--json", default=None, help="also write the timings and final metrics to this file")
    parser.add_argument("--quiet", action="store_true", help="do not echo the run's log")
    parser.add_argument("--debug", action="store_true", help="print tracebacks of errors caught before the run")
    parser.add_argument("overrides", nargs="*", help="run-config overrides key=value (TOML values; bare strings)")
    args = parser.parse_intermixed_args(argv)

    tls = args.tls or args.auth
    try:
        check_flags(args)
        absolute_path_env()
        overrides = parse_overrides(args.overrides)
        supernodes = plan_nodes(overrides, args.supernodes)
    except FedRecError as err:
        if args.debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fedrec-deploy-")).resolve()
    overrides.setdefault("results-dir", str(workdir / "results"))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    overrides.setdefault(
        "run-name", f"deploy-{supernodes}nodes{'-tls' if tls else ''}{'-auth' if args.auth else ''}-{stamp}"
    )
    try:  # every check that needs no Flower, before any process starts (as the launcher and run_serial do)
        from fedrec_flwr.app.preflight import preflight
        from fedrec_flwr.config import default_mapping

        preflight({**default_mapping(), **overrides}, with_data=True)
    except FedRecError as err:
        if args.debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return 2
    project = app_snapshot(workdir / "app") if args.snapshot else None
    print(
        f"deploying {supernodes} SuperNodes (users-per-node {overrides['users-per-node']}), "
        f"{'TLS' if tls else 'insecure'}{' + SuperNode auth' if args.auth else ''}; work folder {workdir}",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    # SIGTERM / SIGHUP end the deployment like Ctrl-C (the `with` below ends every process it started); exit 128 + signal
    previous = {sig: signal.signal(sig, raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    deployment = Deployment(
        workdir, num_supernodes=supernodes, tls=tls, auth=args.auth, **({"project": project} if project else {})
    )
    try:
        with deployment:
            startup = time.monotonic() - started
            print(
                f"SuperLink at {deployment.address}, {supernodes} SuperNodes joined after {startup:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            outcome = deployment.run(overrides, timeout=args.timeout, echo=not args.quiet)
    except (DeploymentError, FedRecError) as err:
        print(f"error: {err}", file=sys.stderr)
        own = run_error(str(err))
        if own:
            print(f"error: the run did not finish: {own}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:
        print(
            f"\nstopped ({stop.args[0] if stop.args else 'Ctrl-C'}): every process of this deployment was ended",
            file=sys.stderr,
        )
        return stop.args[1] if len(stop.args) > 1 else 128 + signal.SIGINT
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        left = deployment.leftover()
        if left:
            print(f"warning: processes still running: {left}", file=sys.stderr)
    result = report(outcome.folder, startup, outcome.seconds, supernodes)
    result.update(
        {
            "tls": tls,
            "auth": args.auth,
            "users-per-node": overrides["users-per-node"],
            "total-seconds": round(time.monotonic() - started, 3),
            "workdir": str(workdir),
        }
    )
    if args.json:
        from fedrec_flwr.io import atomic_write_json

        atomic_write_json(Path(args.json).expanduser(), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
