"""Benchmark: seconds per round, milliseconds per sampled user and peak memory of the simulation, next to a bare
Flower app that does no training (same engine, same number of nodes and messages, empty payloads). Every app of a run
gets the launcher's Ray inline-object limit (``fedrec_flwr.launch.RAY_INLINE_BYTES``, what ``python -m
fedrec_flwr.launch run`` sets) unless ``--ray-default-inline`` keeps Ray's 100 KiB; each row records which, and the
load average when it ended.

Run by hand (not a test), e.g.::

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench/bench_simulation.py --data-root ../shared/data \
        --cases "ml-100k:100:1" "ml-100k:943:1" "ml-100k:943:50" "amazon-video:3000:1" --rounds 3

A case is ``dataset:sampled-users-per-round:users-per-node``. Each case runs Flower's in-process simulation engine
(``flwr.simulation.run_simulation``, the engine ``flwr run`` uses) with one CPU per client actor, trains for
``--rounds`` rounds with no evaluation, and reports the median round. Peak memory is the largest resident set of the
whole process tree (driver, Ray, actors), sampled every 0.2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def tree_rss_bytes(root: int) -> int:
    """Resident memory of ``root`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            statm = (proc / "statm").read_text().split()
        except OSError:
            continue
        pid, ppid = int(proc.name), int(stat[1])
        children.setdefault(ppid, []).append(pid)
        rss[pid] = int(statm[1]) * os.sysconf("SC_PAGE_SIZE")
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


class PeakMemory:
    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_bytes(os.getpid()))
            time.sleep(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


REPLY_BYTES = 110_000
"""``bare+model+reply``'s reply: one float32 array of about a one-user FedNCF train reply on ML-100K (104-116 KB of
touched item rows)."""


def bare_apps(
    num_users: int,
    users_per_node: int,
    sampled: int,
    rounds: int,
    times: list[float],
    payload: dict | None = None,
    reply: bool = False,
    window: int = 0,
):
    """A ServerApp/ClientApp pair with the same messaging pattern and no training; with ``payload`` (name -> array)
    each train message also carries those arrays, as ours carry the shared model; with ``reply`` each reply carries
    :data:`REPLY_BYTES` of array; with ``window`` the ServerApp keeps at most that many messages in flight
    (:mod:`fedrec_flwr.app.message_window`, as ours does by default on this engine)."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    server, client = ServerApp(), ClientApp()

    reply_arrays = np.zeros(REPLY_BYTES // 4, dtype=np.float32) if reply else None

    @client.train()
    def train(message, context):
        content = {"metrics": MetricRecord({"num-examples": 1.0})}
        if reply_arrays is not None:
            content["arrays"] = ArrayRecord({"rows": Array(reply_arrays)})
        return Message(RecordDict(content), reply_to=message)

    @server.main()
    def main(grid, context):
        num_nodes = -(-num_users // users_per_node)
        while len(nodes := sorted(grid.get_node_ids())) < num_nodes:
            time.sleep(0.2)
        for rnd in range(1, rounds + 1):
            start = time.monotonic()
            users = np.random.default_rng([0, rnd]).choice(num_users, size=sampled, replace=False)
            chosen = sorted({nodes[u // users_per_node] for u in users})
            content = {"config": ConfigRecord({"server-round": rnd})}
            if payload:
                content["arrays"] = ArrayRecord({k: Array(v) for k, v in payload.items()})
            messages = [Message(RecordDict(content), dst_node_id=n, message_type="train") for n in chosen]
            if window:
                from fedrec_flwr.app.message_window import WindowedGrid

                list(WindowedGrid(grid, window).send_and_receive(messages, timeout=600))
            else:
                list(grid.send_and_receive(messages, timeout=600))
            times.append(time.monotonic() - start)

    return server, client


def run_case(
    dataset: str,
    sampled: int,
    users_per_node: int,
    rounds: int,
    data_root: str,
    bare: str | None,
    overrides: dict | None = None,
) -> dict:
    """One benchmark row; the run's results folder lives in a ``fedrec-bench-*`` temp folder, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="fedrec-bench-", ignore_cleanup_errors=True) as tmp:
        return _run_case_in(tmp, dataset, sampled, users_per_node, rounds, data_root, bare, overrides)


def _run_case_in(
    tmp: str,
    dataset: str,
    sampled: int,
    users_per_node: int,
    rounds: int,
    data_root: str,
    bare: str | None,
    overrides: dict | None,
) -> dict:
    from flwr.simulation import run_simulation

    from fedrec_flwr.app.runtime import load_split_for
    from fedrec_flwr.config import RunConfig, default_mapping

    mapping = default_mapping()
    mapping.update(
        {
            "dataset": dataset,
            "data-dir": str(Path(data_root) / dataset),
            "num-server-rounds": rounds,
            "fraction-evaluate": 0.0,
            "users-per-node": users_per_node,
            "results-dir": tmp,
            "run-name": "bench",
        }
    )
    mapping.update(overrides or {})
    num_users = load_split_for(RunConfig.from_mapping(mapping)).num_users
    mapping["fraction-train"] = min(1.0, sampled / num_users)
    num_nodes = -(-num_users // users_per_node)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"include_dashboard": False}}
    times: list[float] = []
    from fedrec_flwr.app import flower_patches

    fast = bool(bare) and bare.endswith("@fast")  # the bare app on the patched link state, as ours by default
    with PeakMemory() as memory:
        if bare:
            kind, _, window = bare.removesuffix("@fast").partition("/w")
            payload = None
            if kind in ("bare+model", "bare+model+reply"):
                from fedrec_flwr.app.runtime import build_shared_model

                config = RunConfig.from_mapping(mapping)
                model = build_shared_model(config, load_split_for(config).num_items)
                payload = {k: v.detach().numpy() for k, v in model.shared_state().items()}
            server, client = bare_apps(
                num_users,
                users_per_node,
                sampled,
                rounds,
                times,
                payload,
                reply=kind == "bare+model+reply",
                window=int(window or 0),
            )
        else:
            from fedrec_flwr.app.client_app import make_client_app
            from fedrec_flwr.app.server_app import make_server_app

            server, client = make_server_app(mapping), make_client_app(mapping)
        if fast and not flower_patches.apply():
            raise SystemExit(f"{bare}: the link-state patch does not apply here: {flower_patches.why_not()}")
        try:
            run_simulation(server, client, num_supernodes=num_nodes, backend_config=backend)
        finally:  # ours applies it in this process too (fast-link-state): every app starts from Flower's own
            flower_patches.restore()
    if not bare:
        rows = json.loads((Path(tmp) / "bench" / "metrics.json").read_text())
        times = [r["seconds"] for r in rows]
    steady = times[1:] if len(times) > 1 else times  # the first round includes actor start-up
    per_round = statistics.median(steady)
    label = "fedrec" + "".join(f" {k}={v}" for k, v in (overrides or {}).items())
    return {
        "app": bare or label,
        "dataset": dataset,
        "users": num_users,
        "nodes": num_nodes,
        "sampled-users": sampled,
        "users-per-node": users_per_node,
        "rounds": rounds,
        "seconds-per-round": round(per_round, 2),
        "ms-per-user": round(1000 * per_round / sampled, 1),
        "peak-memory-MiB": round(memory.peak / 2**20),
    }


def toml_value(text: str):
    """``--set``'s value as a TOML literal (``128``, ``0.5``, ``true``, ``"on"``), else the text itself."""
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", default=str(Path(__file__).resolve().parents[3] / "shared" / "data"))
    parser.add_argument(
        "--cases", nargs="+", default=["ml-100k:100:1", "ml-100k:943:1", "ml-100k:943:50", "amazon-video:3000:1"]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--apps",
        nargs="+",
        default=["bare", "bare+model", "fedrec"],
        help="bare: no payload; bare+model: the shared model in every message; bare+model+reply: "
        "and a 110 KB reply (a one-user train reply's size); a bare app's name + '/w<N>': its "
        "ServerApp keeps at most N messages in flight; a bare app's name + '@fast' (last): on "
        "Flower's link state with fedrec_flwr/app/flower_patches.py, as ours by default "
        "(fast-link-state); fedrec: ours (its max-in-flight: the run config's, auto by default); "
        "fedrec+set: ours with --set; fedrec@KEY=VALUE,...: ours with those overrides (several "
        "such apps may run interleaved in one invocation)",
    )
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--ray-default-inline",
        action="store_true",
        help="keep Ray's own 100 KiB inline-object limit instead of the launcher's "
        "RAY_max_direct_call_object_size (fedrec_flwr.launch.RAY_INLINE_BYTES); either way every "
        "app of the run gets the same setting",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run-config overrides for our app; an app named 'fedrec+set' runs ours with them (e.g. "
        "--apps fedrec fedrec+set --set block-training=off: the per-user reference path)",
    )
    args = parser.parse_args()
    from fedrec_flwr.launch import RAY_INLINE_BYTES, RAY_INLINE_ENV

    if args.ray_default_inline:
        os.environ.pop(RAY_INLINE_ENV, None)
    else:  # what `python -m fedrec_flwr.launch run` gives Flower's simulation (launch.flwr_env), unless set
        os.environ.setdefault(RAY_INLINE_ENV, str(RAY_INLINE_BYTES))
    inline = os.environ.get(RAY_INLINE_ENV, "ray default (102400)")
    print(f"{RAY_INLINE_ENV} = {inline}; load average {os.getloadavg()}", flush=True)
    rows = []
    for case in args.cases:
        dataset, sampled, upn = case.split(":")
        overrides = {k: toml_value(v) for k, v in (item.split("=", 1) for item in args.set)}
        for app in args.apps:
            app_overrides = overrides if app == "fedrec+set" else None
            if app.startswith("fedrec@"):  # ours with its own overrides: fedrec@max-in-flight=64,block-training=off
                app_overrides = {k: toml_value(v) for k, v in (i.split("=", 1) for i in app[7:].split(","))}
            row = run_case(
                dataset,
                int(sampled),
                int(upn),
                args.rounds,
                args.data_root,
                None if app.startswith("fedrec") else app,
                app_overrides,
            )
            row.update({"ray-inline-bytes": inline, "load-average": [round(v, 2) for v in os.getloadavg()]})
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| app | dataset | nodes | sampled users | users/node | s/round | ms/user | peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['app']} | {r['dataset']} | {r['nodes']} | {r['sampled-users']} | {r['users-per-node']} | "
            f"{r['seconds-per-round']} | {r['ms-per-user']} | {r['peak-memory-MiB']} |"
        )
    if args.out:
        from fedrec_flwr.io import atomic_write_json

        atomic_write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
