"""Cold start of one deployed ClientApp message: ours against a bare Flower ClientApp, side by side in one run.

In flwr 1.42 a SuperNode runs every message in a new ``flwr-clientapp`` process, so each message pays a Python start,
the imports, the app's runtime build (ours: config, cached split, model), the work, and the reply. This script runs
exactly that per message in a fresh process (``--child``), from a message serialized with Flower's own protobuf
codec (``flwr.common.serde.message_to_proto``), and times each phase with wall-clock stamps:

``start``    parent's ``Popen`` -> the child's first line (interpreter start, site-packages);
``flwr``     ``import flwr.app, flwr.clientapp`` (Flower's own ``flwr-clientapp`` pays this for any app);
``app``      importing the app module (ours: ``fedrec_flwr.app.client_app``; bare: a ClientApp defined in place);
``decode``   the message's protobuf bytes -> ``Message`` (0.44 MB of arrays for ML-100K FedNCF);
``runtime``  ours: :func:`fedrec_flwr.app.runtime.get_runtime` (run config, cached split, one-user model); bare: none;
``work``     the handler (ours: the message's users trained / scored / identified; bare: one metric reply); ours
             runs the default ``block-training = "auto"`` (the block path, :mod:`fedrec_flwr.local.blocks`' own Adam, also
             for one user) and, as a further arm, ``"off"`` (the per-user reference path and the default before:
             its first ``torch.optim`` optimizer imports ``torch._dynamo``, seconds per process);
``reply``    the reply -> protobuf bytes;
``exit``     the child's last stamp -> the parent sees it exit (interpreter teardown).

Not measured here (the same for both apps, Flower's): the SuperNode's poll interval, the FAB install and the gRPC
transfers. ``--deployed ROUNDS`` adds whole deployed rounds, back to back (:func:`deployed`): a bare app on 3
SuperNodes, ours on 3 SuperNodes (:class:`fedrec_flwr.launch.deploy.Deployment`; ML-100K FedNCF, fraction-train 0.1), and
ours in-process (:func:`fedrec_flwr.serial.run_serial`), for the target "deployed round <= 2x (bare deployed round +
in-process work)".

Usage (prints a markdown table and the load average at the start and end; writes JSON with ``--out``)::

    OMP_NUM_THREADS=1 FEDREC_DATA_DIR=/path/to/data nice -n 5 python experiments/bench/bench_deploy.py \\
        [--repeats 5] [--deployed 4] [--out results.json]
"""

from __future__ import annotations

import sys
import time

STAMPS: list[tuple[str, float]] = [("main", time.time())]  # before any other import: the child's first line

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

PHASES = ("start", "flwr", "app", "decode", "runtime", "work", "reply", "exit")
KINDS = ("train", "evaluate", "query.identify")


# ------------------------------------------------------------------------------------------------------- child
def _stamp(name: str) -> None:
    STAMPS.append((name, time.time()))


def child(app_kind: str, message_path: str, context_path: str) -> None:
    """One message in this fresh process; prints ``{phase: unix time}`` as JSON on stdout."""
    import flwr.app  # noqa: F401
    import flwr.clientapp  # noqa: F401

    _stamp("flwr")
    if app_kind == "ours":
        from fedrec_flwr.app.client_app import app
    else:
        from flwr.app import Message, MetricRecord, RecordDict
        from flwr.clientapp import ClientApp

        app = ClientApp()

        def reply(message, context):
            return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=message)

        for kind in KINDS:
            category, _, action = kind.partition(".")
            getattr(app, category)(*([action] if action else []))(reply)
    _stamp("app")
    from flwr.app import Context, RecordDict
    from flwr.common.serde import message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    proto = ProtoMessage()
    proto.ParseFromString(Path(message_path).read_bytes())
    message = message_from_proto(proto)
    saved = json.loads(Path(context_path).read_text())
    context = Context(
        run_id=1, node_id=1, node_config=saved["node_config"], state=RecordDict(), run_config=saved["run_config"]
    )
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 2  # as flwr-clientapp sets them
    _stamp("decode")
    if app_kind == "ours":
        from fedrec_flwr.app.runtime import get_runtime

        get_runtime(context.run_config)
    _stamp("runtime")
    out = app(message, context)
    _stamp("work")
    size = len(message_to_proto(out).SerializeToString())
    _stamp("reply")
    assert not out.has_error(), out.error
    print(json.dumps({"stamps": STAMPS, "reply-bytes": size}), flush=True)


# -------------------------------------------------------------------------------------------- deployed rounds
BARE_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "bareapp"
version = "1.0.0"
dependencies = ["flwr"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "bench"

[tool.flwr.app.components]
serverapp = "bare_app:server"
clientapp = "bare_app:client"

[tool.flwr.app.config]
results-dir = ""
run-name = ""
num-server-rounds = 3
"""

BARE_APP = """\"\"\"A bare Flower app: each round sends arrays of our shapes to every node, which replies one metric.
\"\"\"
import json
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

SHAPES = {shapes}
client = ClientApp()
server = ServerApp()


@client.train()
def reply(message, context):
    return Message(RecordDict({{"metrics": MetricRecord({{"num-examples": 1}})}}), reply_to=message)


@server.main()
def main(grid, context):
    config = context.run_config
    arrays = ArrayRecord({{k: Array(np.zeros(shape, dtype=np.float32)) for k, shape in SHAPES.items()}})
    while len(list(grid.get_node_ids())) < 3:
        time.sleep(0.5)
    seconds = []
    for server_round in range(1, int(config["num-server-rounds"]) + 1):
        started = time.monotonic()
        messages = [Message(RecordDict({{"arrays": arrays}}), dst_node_id=n, message_type="train")
                    for n in grid.get_node_ids()]
        replies = list(grid.send_and_receive(messages, timeout=600))
        assert all(not r.has_error() for r in replies), [r.error for r in replies if r.has_error()]
        seconds.append(time.monotonic() - started)
    folder = Path(config["results-dir"]) / config["run-name"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "learning_curves.png").write_bytes(b"")
    (folder / "summary.tmp").write_text(json.dumps({{"round-seconds": seconds}}))
    os.replace(folder / "summary.tmp", folder / "summary.json")
"""


def _round_seconds(folder: Path) -> list[float]:
    return [float(row["seconds"]) for row in json.loads((folder / "metrics.json").read_text())]


def deployed(work: Path, rounds: int, shapes: dict) -> dict:
    """Round wall times (s), back to back: the bare app on 3 SuperNodes, ours on 3 SuperNodes (ML-100K FedNCF,
    fraction-train 0.1, users-per-node 315, evaluation in the last round only), and ours in-process
    (:func:`fedrec_flwr.serial.run_serial`, same config)."""
    from fedrec_flwr.config import default_mapping
    from fedrec_flwr.launch.deploy import Deployment, app_snapshot
    from fedrec_flwr.serial import run_serial

    bare = work / "bare-app"
    bare.mkdir(parents=True)
    (bare / "pyproject.toml").write_text(BARE_PYPROJECT)
    (bare / "bare_app.py").write_text(BARE_APP.format(shapes=repr(shapes)))
    out: dict = {}
    with Deployment(work / "bare", num_supernodes=3, check_nodes=False, project=bare) as deployment:
        deployment.run({"results-dir": str(work / "results"), "run-name": "bare", "num-server-rounds": rounds})
    out["bare"] = json.loads((work / "results" / "bare" / "summary.json").read_text())["round-seconds"]
    overrides = {
        "dataset": "ml-100k",
        "users-per-node": 315,
        "fraction-train": 0.1,
        "num-server-rounds": rounds,
        "eval-every": rounds,
        "results-dir": str(work / "results"),
    }
    with Deployment(work / "ours", num_supernodes=3, project=app_snapshot(work / "snapshot")) as deployment:
        deployment.run({**overrides, "run-name": "ours"})
    out["ours"] = _round_seconds(work / "results" / "ours")
    run_serial({**default_mapping(), **overrides, "run-name": "serial"})
    out["serial"] = _round_seconds(work / "results" / "serial")
    return out


# ------------------------------------------------------------------------------------------------------ parent
def _messages(folder: Path, run_config: dict, users: list[int]) -> dict[str, Path]:
    """The server's train / evaluate / identify messages to partition 0 (its users ``users``), as protobuf files."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.common.serde import message_to_proto

    from fedrec_flwr.app.runtime import build_shared_model, get_runtime
    from fedrec_flwr.wire import ARRAYS, CONFIG, IDENTIFY

    runtime = get_runtime(run_config)  # loads (and caches on disk) the split once, before any child runs
    model = build_shared_model(runtime.config, runtime.split.num_items)
    arrays = ArrayRecord({k: Array(v.detach().cpu().numpy()) for k, v in model.shared_state().items()})
    config = ConfigRecord({"run": "bench", "durable-round": -1, "server-round": 1, "users": users})
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as the SuperLink's ServerApp has
    paths = {}
    for kind in KINDS:
        content = RecordDict({ARRAYS: arrays, CONFIG: config}) if kind != f"query.{IDENTIFY}" else RecordDict()
        message = Message(content=content, message_type=kind, dst_node_id=1)
        message.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # the SuperLink's job
        paths[kind] = folder / f"{kind}.pb"
        paths[kind].write_bytes(message_to_proto(message).SerializeToString())
    return paths


def run_child(app_kind: str, message: Path, context: Path) -> dict[str, float]:
    """Seconds per :data:`PHASES` of one message in a fresh process."""
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--child", app_kind, str(message), str(context)],
        capture_output=True,
        text=True,
        check=False,
    )
    exited = time.time()
    if done.returncode != 0:
        raise SystemExit(f"child ({app_kind}, {message.name}) failed:\n{done.stderr[-3000:]}")
    stamps = dict(json.loads(done.stdout.strip().splitlines()[-1])["stamps"])
    times = [
        spawned,
        stamps["main"],
        stamps["flwr"],
        stamps["app"],
        stamps["decode"],
        stamps["runtime"],
        stamps["work"],
        stamps["reply"],
        exited,
    ]
    return {phase: b - a for phase, a, b in zip(PHASES, times, times[1:])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="messages of each kind per app (interleaved)")
    parser.add_argument("--dataset", default="ml-100k")
    parser.add_argument("--users-per-node", type=int, default=1)
    parser.add_argument(
        "--deployed",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also time ROUNDS deployed rounds (3 SuperNodes) of ours and of the bare app, and "
        "the same rounds in-process (the last round also evaluates; the others are the "
        "training rounds)",
    )
    parser.add_argument("--out", default=None, help="write the per-message timings and the summary as JSON here")
    args = parser.parse_args(argv)

    from fedrec_flwr.config import default_mapping

    load_start = os.getloadavg()
    run_config = {**default_mapping(), "dataset": args.dataset, "users-per-node": args.users_per_node}
    users = list(range(args.users_per_node))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = _messages(folder, run_config, users)
        contexts = {}
        for arm, block in (("ours", run_config["block-training"]), ("ours block-training=off", "off")):
            contexts[arm] = folder / f"context-{block}.json"
            contexts[arm].write_text(
                json.dumps(
                    {
                        "run_config": {**run_config, "block-training": block},
                        "node_config": {"partition-id": 0, "num-partitions": 1},
                    }
                )
            )
        contexts["bare"] = contexts["ours"]
        size = (paths["train"].stat().st_size) / 1e6
        rows: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.repeats):  # interleaved, so load changes hit every arm alike
            for kind in KINDS:
                for arm, context in contexts.items():
                    if arm.endswith("=off") and kind not in ("train", "evaluate"):
                        continue  # query handlers are always per-user
                    app_kind = "bare" if arm == "bare" else "ours"
                    rows.setdefault(f"{arm} {kind}", []).append(run_child(app_kind, paths[kind], context))
    load_end = os.getloadavg()
    summary = {
        name: {phase: statistics.median(r[phase] for r in runs) for phase in PHASES} for name, runs in rows.items()
    }
    for values in summary.values():
        values["total"] = sum(values[p] for p in PHASES)
    print(
        f"load average at start {load_start[0]:.1f} / {load_start[1]:.1f} / {load_start[2]:.1f}, at end "
        f"{load_end[0]:.1f} / {load_end[1]:.1f} / {load_end[2]:.1f} ({os.cpu_count()} CPUs); train message "
        f"{size:.2f} MB; median of {args.repeats} fresh processes per row, seconds\n"
    )
    print("| message | " + " | ".join(PHASES) + " | total |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for name, values in summary.items():
        print(f"| {name} | " + " | ".join(f"{values[p]:.2f}" for p in (*PHASES, "total")) + " |")
    print()
    for name, values in summary.items():
        if not name.startswith("bare"):
            bare = summary["bare " + name.rsplit(" ", 1)[1]]["total"]
            print(f"{name}: ours / bare = {values['total'] / bare:.2f}x")
    deploy: dict = {}
    if args.deployed:
        from fedrec_flwr.app.runtime import build_shared_model, get_runtime

        runtime = get_runtime(run_config)
        shapes = {
            k: tuple(v.shape)
            for k, v in build_shared_model(runtime.config, runtime.split.num_items).shared_state().items()
        }
        deploy_load = [os.getloadavg()]
        with tempfile.TemporaryDirectory() as tmp:
            deploy = deployed(Path(tmp), args.deployed, shapes)
        deploy_load.append(os.getloadavg())
        train = {arm: statistics.mean(seconds[:-1]) for arm, seconds in deploy.items()}
        print(
            f"\ndeployed, 3 SuperNodes, mean of training rounds 1..{args.deployed - 1} (load average "
            f"{deploy_load[0][0]:.1f} at the start, {deploy_load[1][0]:.1f} at the end): ours {train['ours']:.1f} s, "
            f"bare {train['bare']:.1f} s, ours in-process {train['serial']:.1f} s; ours / (bare + in-process) = "
            f"{train['ours'] / (train['bare'] + train['serial']):.2f}x"
        )
        deploy = {"round-seconds": deploy, "mean-training-round": train, "load-average": deploy_load}
    result = {
        "load-average-start": load_start,
        "load-average-end": load_end,
        "cpus": os.cpu_count(),
        "train-message-mb": size,
        "repeats": args.repeats,
        "dataset": args.dataset,
        "users-per-node": args.users_per_node,
        "median-seconds": summary,
        "runs": rows,
        "deployed": deploy,
    }
    if args.out:
        from fedrec_flwr.io import atomic_write_text

        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
