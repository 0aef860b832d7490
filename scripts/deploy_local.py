#!/usr/bin/env python
"""Run the app end to end on a real Flower deployment on this machine, then report wall time per round.

Starts one ``flower-superlink`` and N ``flower-supernode`` processes on 127.0.0.1 (free ports; optionally TLS and
SuperNode authentication), submits the app with ``flwr run <app> <connection> --stream``, waits for the results
folder, ends every process it started, and prints each round's wall time (``metrics.csv``: ``seconds``, the
round's wall time; ``train-seconds``, its training part) and the final HR@10 / NDCG@10.

Usage::

    python scripts/deploy_local.py --supernodes 3 [--tls] [--auth] [--snapshot] [--workdir DIR] [--json FILE] \\
        [key=value ...]

``key=value`` pairs are run-config overrides (TOML values: strings in quotes, e.g. ``model='mf'``). Without
``users-per-node``, it is ``ceil(users / supernodes)``; with it, ``--supernodes`` may be left out. Relative
``data-dir`` / ``cache-dir`` / ``results-dir`` are made absolute (the ServerApp and ClientApps run elsewhere);
``results-dir`` defaults to ``<workdir>/results``. Logs of every process stay in ``<workdir>/logs``.

Example (MovieLens-100K, 10 SuperNodes of 95 users, 5 rounds, TLS and authentication)::

    FEDREC_DATA_DIR=/path/to/data python scripts/deploy_local.py --supernodes 10 --tls --auth \\
        num-server-rounds=5 eval-every=5 model="'mf'"
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedrec_flwr.deploy import Deployment, DeploymentError, app_snapshot  # noqa: E402
from fedrec_flwr.errors import FedRecError  # noqa: E402

PATH_KEYS = ("data-dir", "cache-dir", "results-dir", "generic-file", "generic-attributes-file")


def parse_overrides(pairs: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            parser.error(f"override {pair!r} is not key=value")
        try:
            overrides[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[key.strip()] = value  # a bare string
    for key in PATH_KEYS:
        if overrides.get(key):
            overrides[key] = str(Path(str(overrides[key])).expanduser().resolve())
    return overrides


def plan_nodes(overrides: dict[str, Any], supernodes: int | None) -> int:
    """Number of SuperNodes, and ``users-per-node`` set in ``overrides``, consistent with the dataset's users."""
    from fedrec_flwr.config import RunConfig, default_mapping
    from fedrec_flwr.runtime import load_split_for

    mapping = default_mapping()
    mapping.update(overrides)
    if "users-per-node" not in overrides:
        mapping["users-per-node"] = 1
    num_users = load_split_for(RunConfig.from_mapping(mapping)).num_users
    if "users-per-node" in overrides:
        needed = -(-num_users // int(overrides["users-per-node"]))
        if supernodes is not None and supernodes != needed:
            raise FedRecError(f"--supernodes {supernodes} does not match users-per-node = {overrides['users-per-node']}: "
                              f"{num_users} users need exactly {needed} SuperNodes")
        return needed
    supernodes = supernodes or 3
    per_node = -(-num_users // supernodes)
    if -(-num_users // per_node) != supernodes:
        raise FedRecError(f"{num_users} users cannot be split into exactly {supernodes} non-empty blocks of equal size "
                          f"(users-per-node {per_node} gives {-(-num_users // per_node)} SuperNodes); choose another "
                          "--supernodes or set users-per-node")
    overrides["users-per-node"] = per_node
    return supernodes


def report(folder: Path, startup: float, run_seconds: float, supernodes: int) -> dict[str, Any]:
    """Print the per-round table and the final metrics; returns them as a mapping."""
    with open(folder / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    summary = json.loads((folder / "summary.json").read_text())
    print(f"\n{'round':>5}  {'seconds':>8}  {'train-s':>8}  {'HR@10':>7}  {'NDCG@10':>7}")
    for row in rows:
        hr = f"{float(row['HR@10']):.4f}" if row.get("HR@10") else "-"
        ndcg = f"{float(row['NDCG@10']):.4f}" if row.get("NDCG@10") else "-"
        print(f"{row['round']:>5}  {float(row['seconds']):8.1f}  {float(row.get('train-seconds') or 0):8.1f}  "
              f"{hr:>7}  {ndcg:>7}")
    seconds = [float(r["seconds"]) for r in rows]
    final = summary.get("final", {})
    result = {
        "supernodes": supernodes, "rounds": len(rows), "round-seconds": seconds,
        "train-seconds": [float(r.get("train-seconds") or 0) for r in rows],
        "mean-round-seconds": sum(seconds) / len(seconds) if seconds else None,
        "startup-seconds": round(startup, 3), "run-seconds": round(run_seconds, 3),
        "server-total-seconds": summary.get("total-seconds"),
        "HR@10": final.get("HR@10"), "NDCG@10": final.get("NDCG@10"), "folder": str(folder),
    }
    print(f"\n{supernodes} SuperNodes: mean {result['mean-round-seconds']:.1f} s per round over {len(rows)} rounds; "
          f"startup {startup:.1f} s, run {run_seconds:.1f} s (submit to results), ServerApp "
          f"{summary.get('total-seconds')} s")
    print(f"final HR@10 {final.get('HR@10', float('nan')):.4f}  NDCG@10 {final.get('NDCG@10', float('nan')):.4f}"
          f"  -> {folder}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--supernodes", type=int, default=None, help="SuperNodes to start (default 3)")
    parser.add_argument("--tls", action="store_true", help="TLS on the SuperLink (a CA made for this run)")
    parser.add_argument("--auth", action="store_true",
                        help="SuperNode authentication (registered keys only; implies --tls)")
    parser.add_argument("--workdir", default=None, help="folder for FLWR_HOMEs, logs, certificates, keys")
    parser.add_argument("--snapshot", action="store_true",
                        help="flwr run a lean copy of the app (faster FAB build; same code)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the results")
    parser.add_argument("--json", default=None, help="also write the timings and final metrics to this file")
    parser.add_argument("--quiet", action="store_true", help="do not echo the run's log")
    parser.add_argument("overrides", nargs="*", help="run-config overrides key=value (TOML values)")
    args = parser.parse_args(argv)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fedrec-deploy-")).resolve()
    overrides = parse_overrides(args.overrides, parser)
    tls = args.tls or args.auth
    try:
        supernodes = plan_nodes(overrides, args.supernodes)
    except FedRecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    overrides.setdefault("results-dir", str(workdir / "results"))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    overrides.setdefault("run-name", f"deploy-{supernodes}nodes{'-tls' if tls else ''}{'-auth' if args.auth else ''}"
                                     f"-{stamp}")
    project = app_snapshot(workdir / "app") if args.snapshot else None
    print(f"deploying {supernodes} SuperNodes (users-per-node {overrides['users-per-node']}), "
          f"{'TLS' if tls else 'insecure'}{' + SuperNode auth' if args.auth else ''}; work folder {workdir}",
          file=sys.stderr, flush=True)
    started = time.monotonic()
    deployment = Deployment(workdir, num_supernodes=supernodes, tls=tls, auth=args.auth,
                            **({"project": project} if project else {}))
    try:
        with deployment:
            startup = time.monotonic() - started
            print(f"SuperLink at {deployment.address}, {supernodes} SuperNodes joined after {startup:.1f} s",
                  file=sys.stderr, flush=True)
            outcome = deployment.run(overrides, timeout=args.timeout, echo=not args.quiet)
    except (DeploymentError, FedRecError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        left = deployment.leftover()
        if left:
            print(f"warning: processes still running: {left}", file=sys.stderr)
    result = report(outcome.folder, startup, outcome.seconds, supernodes)
    result.update({"tls": tls, "auth": args.auth, "users-per-node": overrides["users-per-node"],
                   "total-seconds": round(time.monotonic() - started, 3), "workdir": str(workdir)})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
