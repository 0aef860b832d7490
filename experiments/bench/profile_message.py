"""Where one message's milliseconds go inside a simulation worker: our ClientApp against a bare one.

Records real train (and evaluate) messages and node contexts of a ``run_serial`` run (default config: ML-100K, FedNCF,
one user per node, ``block-training = "auto"``), then replays them in this process the way a Ray client actor of
Flower's simulation engine handles a message (``flwr.simulation.ray_transport.ray_actor``): unpickle the message and
the node's context (Ray ships both per call), run the app, pickle the reply and the updated context. Each phase is
timed for our ClientApp and for a bare ClientApp that replies with one metric to the same message (``bare``) or that
also decodes the message's arrays (``bare+decode``); ``--profile`` prints a cProfile of our handler over the replayed
messages. The worker's runtime (config, split, model) is warm, as in an actor that has served earlier messages.

Run by hand (not a test)::

    OMP_NUM_THREADS=1 FEDREC_DATA_DIR=../shared/data .venv/bin/python experiments/bench/profile_message.py \
        --messages 200 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pickle
import pstats
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def record_messages(mapping: dict, server_round: int, limit: int) -> dict[str, list[tuple[bytes, bytes]]]:
    """``{"train": [...], "evaluate": [...]}`` of pickled ``(message, context)`` as node handlers saw them in round
    ``server_round`` of a serial run (at most ``limit`` each)."""
    from flwr.app import Message

    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.serial import run_serial

    seen: dict[str, list[tuple[bytes, bytes]]] = {"train": [], "evaluate": []}

    def recorder(message: Message, context, call_next):
        kind = message.metadata.message_type
        rnd = message.content["config"].get("server-round") if "config" in message.content else None
        if kind in seen and rnd == server_round and len(seen[kind]) < limit:
            seen[kind].append((pickle.dumps(message, protocol=5), pickle.dumps(context, protocol=5)))
        return call_next(message, context)

    run_serial(mapping, client_app=make_client_app(mapping, mods=[recorder]))
    return seen


def bare_app(decode: bool):
    from flwr.app import Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fedrec_flwr.arrays import decode_array

    app = ClientApp()

    def reply(message, context):
        if decode and "arrays" in message.content:
            {k: decode_array(a) for k, a in message.content["arrays"].items()}
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1.0})}), reply_to=message)

    app.train()(reply)
    app.evaluate()(reply)
    return app


def replay(app, recorded: list[tuple[bytes, bytes]], profiler: cProfile.Profile | None = None) -> dict:
    """Median milliseconds of each phase over ``recorded`` (and bytes shipped back)."""
    phases: dict[str, list[float]] = {"unpickle": [], "handler": [], "pickle-reply": [], "total": []}
    sizes = []
    for message_bytes, context_bytes in recorded:
        t0 = time.perf_counter()
        message, context = pickle.loads(message_bytes), pickle.loads(context_bytes)
        t1 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        reply = app(message=message, context=context)
        if profiler is not None:
            profiler.disable()
        t2 = time.perf_counter()
        out = pickle.dumps((reply, context), protocol=5)
        t3 = time.perf_counter()
        if reply.has_error():
            raise RuntimeError(reply.error.reason)
        for name, value in (("unpickle", t1 - t0), ("handler", t2 - t1), ("pickle-reply", t3 - t2), ("total", t3 - t0)):
            phases[name].append(1000 * value)
        sizes.append(len(out))
    result = {name: round(statistics.median(values), 3) for name, values in phases.items()}
    result["reply+context bytes"] = int(statistics.median(sizes))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200, help="train messages recorded (evaluate: the same)")
    parser.add_argument("--repeats", type=int, default=3, help="replays of the recorded messages per app (interleaved)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of our train handler")
    parser.add_argument(
        "--before",
        action="store_true",
        help="add the arm 'ours, formula Adam': block_optim.FUSED_ADAM off, which is what every NCF block "
        "ran before commit 914133e (the fused kernel was skipped for NCF's transposed gradients)",
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config overrides")
    args = parser.parse_args()

    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.config import default_mapping

    mapping = default_mapping()
    mapping.update(
        {
            "num-server-rounds": 2,
            "fraction-train": min(1.0, args.messages / 943),
            "fraction-evaluate": min(1.0, args.messages / 943),
            "eval-every": 1,
            "results-dir": tempfile.mkdtemp(prefix="fedrec-profile-"),
            "run-name": "profile",
        }
    )
    for item in args.set:
        key, value = item.split("=", 1)
        mapping[key] = type(mapping[key])(value) if key in mapping and not isinstance(mapping[key], bool) else value
    started = time.perf_counter()
    recorded = record_messages(mapping, server_round=2, limit=args.messages)
    print(
        f"recorded {len(recorded['train'])} train and {len(recorded['evaluate'])} evaluate messages of round 2 "
        f"in {time.perf_counter() - started:.1f} s; load average {os.getloadavg()}",
        flush=True,
    )
    ours = make_client_app(None)
    apps = {"ours": ours, "bare": bare_app(False), "bare+decode": bare_app(True)}
    if args.before:
        apps["ours, formula Adam"] = ours
    rows = []
    from fedrec_flwr.local import block_optim

    for kind in ("train", "evaluate"):
        for rep in range(args.repeats):
            for name, app in apps.items():
                block_optim.FUSED_ADAM = name != "ours, formula Adam"
                row = {"kind": kind, "app": name, "repeat": rep, **replay(app, recorded[kind])}
                rows.append(row)
                print(json.dumps(row), flush=True)
    block_optim.FUSED_ADAM = True
    print("\n| message | app | handler ms (median of repeats) | unpickle + handler + pickle ms |\n|---|---|---|---|")
    for kind in ("train", "evaluate"):
        for name in apps:
            mine = [r for r in rows if r["kind"] == kind and r["app"] == name]
            print(
                f"| {kind} | {name} | {statistics.median(r['handler'] for r in mine):.2f} | "
                f"{statistics.median(r['total'] for r in mine):.2f} |"
            )
    if args.profile:
        profiler = cProfile.Profile()
        replay(ours, recorded["train"], profiler)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        print(text.getvalue())
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue())
    print(f"load average at the end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
