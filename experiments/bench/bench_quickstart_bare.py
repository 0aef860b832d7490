"""The default quickstart's message pattern through ``flwr run``, with a bare app that does no work.

The speed target asks the default quickstart (ML-100K, 943 one-user SuperNodes, FedNCF, 100 rounds, evaluation of every node
every 10 rounds) to take at most 0.4x the 17 minutes it took at commit daae3bd. This script
measures what Flower 1.42's simulation engine itself needs for exactly that message pattern, with a bare
ServerApp/ClientApp that trains and scores nothing:

* start: one query to each of the 943 nodes (ours: ``identify``);
* rounds 1..R: a train message to each node of the users :func:`fedrec_flwr.wire.sample_users` draws (94-95 of 943
  at ``fraction-train`` 0.1, the strategy's own sampler and seed), carrying an ``ArrayRecord`` of the shared model's
  shapes (NCF d=32 on ML-100K: 0.44 MB) and a ``ConfigRecord``; each node replies with one float32 array of
  ``--reply-floats`` values (default 26,000: about 104 KB, the median size of our one-user train reply) and a metric;
* every ``eval-every`` rounds and after the last: an evaluate message with the same arrays to all 943 nodes, each
  replying with seven metrics.

It runs through :func:`fedrec_flwr.launch.flwr_run` (the quickstart's launcher: a local SuperLink, ``flwr run``,
Flower's default simulation resources) and prints the wall time, the ServerApp's time and its training / evaluation
round times; ``--ours`` runs our default quickstart the same way right after (back to back), ``--ours-rounds`` with
fewer rounds. If the bare app alone needs more than 0.4 x 17 min, the target cannot be met with one user per node on
this engine, whatever our ClientApp does.

Usage::

    OMP_NUM_THREADS=1 FEDREC_DATA_DIR=../shared/data .venv/bin/python experiments/bench/bench_quickstart_bare.py \\
        [--rounds 100] [--ours] [--out results/quickstart-bare.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BEFORE_SECONDS = 17 * 60
"""The default quickstart's wall time at commit daae3bd (the baseline of the speed target)."""

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_deploy import BARE_PYPROJECT  # noqa: E402  (bench_deploy's bare project; here another module and more keys)

PYPROJECT = BARE_PYPROJECT.replace('"bare_app:', '"bare_quickstart:').replace(
    "num-server-rounds = 3\n",
    "num-server-rounds = 100\nfraction-train = 0.1\neval-every = 10\nnum-users = 943\n"
    "seed = 0\nreply-floats = REPLY_FLOATS\n",
)
assert "bare_quickstart:client" in PYPROJECT and "REPLY_FLOATS" in PYPROJECT, "bench_deploy.BARE_PYPROJECT changed"

APP = """\"\"\"A bare Flower app with the default quickstart's message pattern (experiments/bench/bench_quickstart_bare.py).\"\"\"
import json
import os
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from fedrec_flwr.wire import sample_users

SHAPES = {shapes}
client = ClientApp()
server = ServerApp()
METRIC_KEYS = ("HR@5", "NDCG@5", "HR@10", "NDCG@10", "HR@20", "NDCG@20")


@client.train()
def train(message, context):
    size = int(context.run_config["reply-floats"])
    arrays = ArrayRecord({{"update": Array(np.zeros(size, dtype=np.float32))}})
    return Message(RecordDict({{"arrays": arrays, "metrics": MetricRecord({{"num-examples": 1.0}})}}),
                   reply_to=message)


@client.evaluate()
def evaluate(message, context):
    metrics = {{key: 0.0 for key in METRIC_KEYS}}
    metrics["num-examples"] = 1.0
    return Message(RecordDict({{"metrics": MetricRecord(metrics)}}), reply_to=message)


@client.query("identify")
def identify(message, context):
    return Message(RecordDict({{"config": ConfigRecord({{"partition-id": 0}})}}), reply_to=message)


def _send(grid, nodes, kind, content):
    messages = [Message(RecordDict(content), dst_node_id=n, message_type=kind) for n in nodes]
    replies = list(grid.send_and_receive(messages, timeout=600))
    bad = [r.error.reason for r in replies if r.has_error()]
    assert not bad and len(replies) == len(messages), (len(replies), bad[:3])


@server.main()
def main(grid, context):
    config = context.run_config
    started = time.monotonic()
    num_users, rounds, every = int(config["num-users"]), int(config["num-server-rounds"]), int(config["eval-every"])
    while len(nodes := sorted(grid.get_node_ids())) < num_users:
        time.sleep(0.2)
    t = time.monotonic()
    _send(grid, nodes, "query.identify", {{"config": ConfigRecord({{"action": "identify"}})}})
    out = {{"identify-seconds": time.monotonic() - t, "wait-nodes-seconds": t - started, "train": [], "evaluate": []}}
    arrays = ArrayRecord({{k: Array(np.zeros(shape, dtype=np.float32)) for k, shape in SHAPES.items()}})
    for server_round in range(1, rounds + 1):
        users = sample_users(int(config["seed"]), server_round, num_users, float(config["fraction-train"]))
        t = time.monotonic()
        _send(grid, [nodes[u] for u in users], "train",
              {{"arrays": arrays, "config": ConfigRecord({{"server-round": server_round}})}})
        out["train"].append([server_round, len(users), time.monotonic() - t])
        if server_round % every == 0 or server_round == rounds:
            t = time.monotonic()
            _send(grid, nodes, "evaluate", {{"arrays": arrays, "config": ConfigRecord({{"server-round": server_round}})}})
            out["evaluate"].append([server_round, len(nodes), time.monotonic() - t])
    out["serverapp-seconds"] = time.monotonic() - started
    folder = Path(config["results-dir"]) / config["run-name"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.tmp").write_text(json.dumps(out))
    os.replace(folder / "summary.tmp", folder / "summary.json")
"""


def model_shapes() -> dict[str, tuple[int, ...]]:
    """The default config's shared arrays on ML-100K (key -> shape), as the strategy sends them."""
    from fedrec_flwr.app.runtime import build_shared_model, load_split_for
    from fedrec_flwr.config import RunConfig, default_mapping

    config = RunConfig.from_mapping(default_mapping())
    model = build_shared_model(config, load_split_for(config).num_items)
    return {key: tuple(value.shape) for key, value in model.shared_state().items()}


def summarize_bare(summary: dict, wall: float) -> dict:
    train = [row[2] for row in summary["train"]]
    evaluate = [row[2] for row in summary["evaluate"]]
    return {
        "app": "bare",
        "wall-seconds": round(wall, 1),
        "serverapp-seconds": round(summary["serverapp-seconds"], 1),
        "identify-seconds": round(summary["identify-seconds"], 2),
        "rounds": len(train),
        "train-round-mean": round(statistics.mean(train), 3),
        "train-round-median": round(statistics.median(train), 3),
        "train-ms-per-message": round(1000 * sum(train) / sum(row[1] for row in summary["train"]), 2),
        "evaluate-rounds": len(evaluate),
        "evaluate-round-mean": round(statistics.mean(evaluate), 2),
        "evaluate-ms-per-message": round(1000 * sum(evaluate) / sum(row[1] for row in summary["evaluate"]), 2),
        "train-total": round(sum(train), 1),
        "evaluate-total": round(sum(evaluate), 1),
    }


def summarize_ours(folder: Path, wall: float) -> dict:
    rows = json.loads((folder / "metrics.json").read_text())
    seconds = [float(r["seconds"]) for r in rows]
    return {
        "app": "ours",
        "wall-seconds": round(wall, 1),
        "rounds": len(rows),
        "round-seconds-total": round(sum(seconds), 1),
        "round-mean": round(statistics.mean(seconds), 3),
        "keys": sorted(rows[0]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--reply-floats", type=int, default=26000)
    parser.add_argument("--ours", action="store_true", help="then run our default quickstart the same way")
    parser.add_argument("--ours-rounds", type=int, default=None, help="rounds of our run (default: --rounds)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)

    from fedrec_flwr.launch import flwr_run

    work = Path(tempfile.mkdtemp(prefix="fedrec-bare-quickstart-"))
    project = work / "bare-quickstart"
    project.mkdir()
    # reply-floats is not one of our project's keys, which flwr_run passes on as they are: set as the default
    (project / "pyproject.toml").write_text(PYPROJECT.replace("REPLY_FLOATS", str(args.reply_floats)))
    (project / "bare_quickstart.py").write_text(APP.format(shapes=repr(model_shapes())))
    rows = []
    load = [round(v, 2) for v in os.getloadavg()]
    started = time.monotonic()
    result = flwr_run(
        {
            "results-dir": str(work / "results"),
            "run-name": "bare",
            "num-server-rounds": args.rounds,
            "eval-every": args.eval_every,
        },
        num_supernodes=943,
        flwr_home=work / ".flwr",
        project=project,
        check=False,
        capture=True,
        timeout=args.timeout,
    )
    wall = time.monotonic() - started
    if result.returncode != 0:
        print(result.stdout[-4000:], file=sys.stderr)
        return 1
    row = summarize_bare(json.loads((work / "results" / "bare" / "summary.json").read_text()), wall)
    row.update(
        {
            "load-start": load,
            "load-end": [round(v, 2) for v in os.getloadavg()],
            "vs-17-min": round(wall / BEFORE_SECONDS, 3),
        }
    )
    rows.append(row)
    print(json.dumps(row), flush=True)
    if args.ours:
        load = [round(v, 2) for v in os.getloadavg()]
        rounds = args.ours_rounds or args.rounds
        started = time.monotonic()
        result = flwr_run(
            {
                "results-dir": str(work / "results"),
                "run-name": "ours",
                "num-server-rounds": rounds,
                "eval-every": args.eval_every,
            },
            flwr_home=work / ".flwr",
            capture=True,
            timeout=args.timeout,
        )
        wall = time.monotonic() - started
        if result.returncode != 0:
            print(result.stdout[-4000:], file=sys.stderr)
            return 1
        row = summarize_ours(work / "results" / "ours", wall)
        row.update(
            {
                "load-start": load,
                "load-end": [round(v, 2) for v in os.getloadavg()],
                "vs-17-min": round(wall / BEFORE_SECONDS, 3),
            }
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        from fedrec_flwr.io import atomic_write_json

        atomic_write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
