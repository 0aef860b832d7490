"""Flower's strategies on federated recommenders through the adapter: one command, resumable.

    python -m experiments.flower_strategies.run [--rounds 100] [--seeds 0,1,2] [--shard 0/1]   # missing runs, tables

Protocol (the HF-KCU experiments', imported from :mod:`experiments.hfkcu.methods`): leave-one-out with 99 test
negatives, 100 rounds (``--rounds``: runs of another length go to ``results/runs-<rounds>r``), 10% of users per round,
one local epoch (Adam 0.01, batch 256, 4 negatives per positive), every user evaluated after the last round; here **one user per node** (``users-per-node = 1``), so a Flower strategy's "client"
is a user, as robust aggregation assumes (``item-fedavg`` gives the same model for any grouping).

Arms (:data:`ARMS`): ``item-fedavg`` (our default, ``"touched"`` rows) and, through
:class:`fedrec_flwr.strategies.flower_adapter.FlowerStrategyAdapter`, Flower's FedAvg, FedAvgM, FedAdam, FedYogi, FedProx,
FedMedian and FedTrimmedAvg, each with Flower's default arguments except where :data:`ARMS` says (FedAvgM's default
momentum 0 would make it FedAvg; FedProx's ``proximal_mu`` must be > 0 to differ from FedAvg; our clients honour it
with the paper's proximal term, :class:`fedrec_flwr.local.training.ProximalTerm`). Poisoning (:data:`POISON_ARMS`): ML-100K plus 100 fake users who rate one unpopular
target item and the 10 most popular items (:func:`experiments.hfkcu.poison.poisoned_data`, target seed 0), FedMF,
``item-fedavg`` against FedMedian, FedTrimmedAvg and Krum; measured: the target's exposure (share of genuine users with
it in their top 10 of the items they never rated) and mean percentile, and HR@10 of the genuine users.

Measured per run: HR@10 / NDCG@10 after the last round; seconds per round (server wall time of a training round, the
serial grid running every client in this process); bytes per round, counted by a client mod on every train message
(sent: the arrays the server sends; received: the reply's arrays; the payload of each ``Array``), and the bytes of the
dense replies the adapter builds in the server's memory (what a plain Flower client would send).

Jobs run in priority order (ML-100K FedMF seed 0, the poisoning case, then the other datasets, models and seeds);
finished jobs are skipped, several processes share the jobs (``--shard`` or claims). The tables are rewritten after
every job: ``results/table.md`` / ``.csv`` and ``results/poison.md`` / ``.csv``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.common import claimed, markdown, quiet_flower, run_jobs, write_csv
from experiments.hfkcu.methods import DATASETS, MODELS, PROTOCOL, ROUNDS
from fedrec_flwr.config import make_run_config
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.io import atomic_write_json, atomic_write_text

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(__file__).resolve().parent / ".cache"

FLOWER = "flwr.serverapp.strategy:"
ARMS = {
    "item-fedavg": ("item-fedavg", ""),
    "item-fedavg-selected": ("item-fedavg", "", {"item-aggregation": "selected"}),
    "FedAvg": (FLOWER + "FedAvg", ""),
    "FedAvg-by-users": (FLOWER + "FedAvg", "weighted_by_key=num-users"),
    "FedAvgM": (FLOWER + "FedAvgM", "server_momentum=0.9"),
    "FedAdam": (FLOWER + "FedAdam", ""),
    "FedYogi": (FLOWER + "FedYogi", ""),
    "FedProx": (FLOWER + "FedProx", "proximal_mu=0.1"),
    "FedMedian": (FLOWER + "FedMedian", ""),
    "FedTrimmedAvg": (FLOWER + "FedTrimmedAvg", ""),
}
"""Arm -> (``strategy``, ``strategy-args``[, other run-config keys]). ``item-fedavg-selected`` is the average FedAvg
through the adapter equals when users have equal example counts (here they do not: it shows that weighting);
``FedAvg-by-users`` weights each reply by its ``num-users`` instead of ``num-examples``, which with one user per node
and FedMF (no dense parameters) is exactly ``item-fedavg-selected``."""

POISON_ARMS = {
    "item-fedavg": ARMS["item-fedavg"],
    "FedMedian": ARMS["FedMedian"],
    "FedTrimmedAvg": ARMS["FedTrimmedAvg"],
    "Krum": (FLOWER + "Krum", "num_malicious_nodes=10"),
}
"""The poisoning case's arms (Krum told to expect 10 malicious clients: about 10% of a round's 104 sampled users)."""

POISON_FAKES = 100


def runs_folder(rounds: int) -> Path:
    """Where runs of ``rounds`` rounds go (the protocol's 100: ``results/runs``)."""
    return RESULTS / ("runs" if rounds == ROUNDS else f"runs-{rounds}r")


def config_for(
    dataset: str, model: str, arm: tuple[str, str], seed: int, folder: Path, data_dir: str, rounds: int, **extra
):
    overrides = {
        **PROTOCOL,
        **MODELS[model],
        "dataset": dataset,
        "seed": seed,
        "users-per-node": 1,
        "num-server-rounds": rounds,
        "eval-every": rounds,
        "strategy": arm[0],
        "strategy-args": arm[1],
        "results-dir": str(folder.parent),
        "run-name": folder.name,
        **(arm[2] if len(arm) > 2 else {}),
        **extra,
    }
    if data_dir and dataset != "generic":
        overrides["data-dir"] = str(Path(data_dir) / dataset)
    return make_run_config(**overrides)


class ByteCounter:
    """A client mod that adds up the array payload (bytes of each ``Array``) of train messages and their replies."""

    def __init__(self) -> None:
        self.sent = self.received = 0
        self.messages = 0

    def __call__(self, message, context, call_next):
        reply = call_next(message, context)
        if message.metadata.message_type == "train":
            self.messages += 1
            self.sent += sum(len(a.data) for r in message.content.array_records.values() for a in r.values())
            if not reply.has_error():
                self.received += sum(len(a.data) for r in reply.content.array_records.values() for a in r.values())
        return reply


def train(config, out: Path, at_end=None) -> None:
    """Run ``config`` on the serial grid with byte counting; write ``measures.json`` (or ``refused.json``)."""
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.app.runtime import get_runtime
    from fedrec_flwr.serial import run_serial

    with claimed(out, RESULTS, done_file="measures.json") as mine:
        if not mine:
            return
        if (out / "refused.json").is_file():
            return
        (out / "summary.json").unlink(missing_ok=True)  # an interrupted run is redone
        counter, extra = ByteCounter(), {}
        layout = get_runtime(config.to_dict()).layout
        dense_bytes = sum(int(np.prod(s)) * 4 for s in layout.shared_shapes.values())

        def on_round(view) -> None:
            if view.server_round == config.num_server_rounds and at_end is not None:
                extra.update(at_end(view))

        mapping = config.to_dict()
        try:
            run_serial(mapping, client_app=make_client_app(mapping, mods=[counter]), on_round=on_round)
        except ConfigError as err:
            atomic_write_json(out / "refused.json", {"reason": str(err)})
            print(f"refused: {err}", flush=True)
            return
        rows = json.loads((out / "metrics.json").read_text())
        last = [r for r in rows if "HR@10" in r][-1]
        replies = sum(r.get("num-replies", 0) for r in rows)
        atomic_write_json(
            out / "measures.json",
            {
                "HR@10": last["HR@10"],
                "NDCG@10": last["NDCG@10"],
                "seconds-per-round": float(np.mean([r["train-seconds"] for r in rows])),
                "sent-bytes-per-round": counter.sent / len(rows),
                "received-bytes-per-round": counter.received / len(rows),
                "dense-reply-bytes-per-round": dense_bytes * replies / len(rows),
                "replies-per-round": replies / len(rows),
                **extra,
            },
        )


def run_job(job) -> None:
    kind, dataset, model, arm, seed, data_dir, rounds = job
    if kind == "main":
        out = runs_folder(rounds) / dataset / model / arm / f"seed-{seed}"
        train(config_for(dataset, model, ARMS[arm], seed, out, data_dir, rounds), out)
    else:
        run_poison(model, arm, seed, data_dir, rounds)
    report(rounds)


def run_poison(model: str, arm: str, seed: int, data_dir: str, rounds: int) -> None:
    from experiments.hfkcu.analysis import exposure, private_records
    from experiments.hfkcu.poison import FAKE_USER_BASE, poisoned_data
    from fedrec_flwr.app.runtime import get_runtime

    path, target_raw = poisoned_data("ml-100k", data_dir, POISON_FAKES, 0, CACHE)
    out = runs_folder(rounds) / "poison" / model / arm / f"seed-{seed}"
    config = config_for(
        "generic",
        model,
        POISON_ARMS[arm],
        seed,
        out,
        data_dir,
        rounds,
        generic_file=str(path),
        generic_columns="user,item,rating,timestamp",
    )
    split = get_runtime(config.to_dict()).split
    fakes = np.array([int(u) >= FAKE_USER_BASE for u in split.user_ids])
    genuine = np.flatnonzero(~fakes).astype(np.int64)
    target = int(np.flatnonzero(split.item_ids.astype(str) == target_raw)[0])

    def at_end(view) -> dict:
        runtime = get_runtime(view.config.to_dict())
        arrays = {k: v.numpy() for k, v in view.arrays.items()}
        metrics = view.strategy.evaluate_arrays(view.grid, view.arrays, view.server_round, users=genuine)
        seen = exposure(runtime, private_records(view.grid, genuine), arrays, genuine, target)
        return {
            "genuine-HR@10": metrics.get("HR@10"),
            "genuine-NDCG@10": metrics.get("NDCG@10"),
            **seen,
            "target-item": target,
            "fake-users": int(fakes.sum()),
        }

    train(config, out, at_end)


# ---------------------------------------------------------------------------------------------- tables
def _collect(folder: Path) -> pd.DataFrame:
    rows = []
    for path in sorted(folder.glob("**/seed-*")):
        parts = path.relative_to(folder).parts
        row = {"dataset": parts[0], "model": parts[1], "strategy": parts[2], "seed": int(parts[3][5:])}
        if (path / "measures.json").is_file():
            rows.append({**row, **json.loads((path / "measures.json").read_text())})
        elif (path / "refused.json").is_file():
            rows.append({**row, "refused": json.loads((path / "refused.json").read_text())["reason"]})
    return pd.DataFrame(rows)


def _summarise(frame: pd.DataFrame, keys: list[str], columns: dict[str, str], order: list[str]) -> pd.DataFrame:
    out = []
    for key, group in frame.groupby(keys, sort=False):
        row = dict(zip(keys, key))
        done = group[group["refused"].isna()] if "refused" in group else group
        row["seeds"] = ",".join(str(s) for s in sorted(done["seed"])) or "-"
        if done.empty:
            row.update({name: "-" for name in columns.values()})
            row["note"] = "refused: " + str(group["refused"].iloc[0]).split(";")[0]
        else:
            for column, name in columns.items():
                values = done[column].astype(float) / (1e6 if "bytes" in column else 1.0)
                digits = 2 if "bytes" in column or "seconds" in column else 4
                std = f" ± {values.std():.{digits}f}" if len(values) > 1 else ""
                row[name] = f"{values.mean():.{digits}f}{std}" if values.notna().all() else "-"
            row["note"] = ""
        out.append(row)
    table = pd.DataFrame(out)
    table["_order"] = table["strategy"].map({s: i for i, s in enumerate(order)})
    if "dataset" in table:
        table["_dataset"] = table["dataset"].map({d: i for i, d in enumerate(DATASETS)})
        keys = ["_dataset", *keys[1:]]
    return table.sort_values([*keys[:-1], "_order"]).drop(columns=[c for c in table if c.startswith("_")])


MAIN_COLUMNS = {
    "HR@10": "HR@10",
    "NDCG@10": "NDCG@10",
    "seconds-per-round": "s/round",
    "sent-bytes-per-round": "MB sent/round",
    "received-bytes-per-round": "MB received/round",
    "dense-reply-bytes-per-round": "MB of dense replies (server memory)/round",
}
POISON_COLUMNS = {
    "exposure": "exposure",
    "target-percentile": "target percentile",
    "genuine-HR@10": "HR@10 (genuine)",
    "genuine-NDCG@10": "NDCG@10 (genuine)",
    "seconds-per-round": "s/round",
}


def report(rounds: int = ROUNDS) -> None:
    """Write ``table.*`` and ``poison.*`` (``table-<rounds>r.*`` ... for another length) from the finished runs."""
    frame = _collect(runs_folder(rounds))
    if frame.empty:
        return
    arms = {**ARMS, **POISON_ARMS}
    if "dense-reply-bytes-per-round" in frame:  # only the adapter builds dense replies
        adapted = frame["strategy"].map(lambda a: arms[a][0].startswith(FLOWER))
        frame.loc[~adapted, "dense-reply-bytes-per-round"] = np.nan
    tag = "" if rounds == ROUNDS else f"-{rounds}r"
    main = frame[frame["dataset"] != "poison"]
    poison = frame[frame["dataset"] == "poison"]
    note = (
        f"{rounds} rounds. Generated by `python -m experiments.flower_strategies.run --rounds {rounds}` (see its "
        "docstring for the protocol). Mean ± "
        "std over the seeds listed; bytes are array payloads per training round (sent: the full shared arrays "
        "to each sampled user; received: the row-sparse replies; dense replies: what the adapter expands them to "
        "in the server's memory). MB = 10^6 bytes.\n\n"
    )
    if not main.empty:
        table = _summarise(main, ["dataset", "model", "strategy"], MAIN_COLUMNS, list(ARMS))
        write_csv(table, RESULTS / f"table{tag}.csv")
        atomic_write_text(
            RESULTS / f"table{tag}.md", "# Flower strategies through the adapter\n\n" + note + markdown(table)
        )
    if not poison.empty:
        table = _summarise(poison, ["model", "strategy"], POISON_COLUMNS, list(POISON_ARMS))
        write_csv(table, RESULTS / f"poison{tag}.csv")
        atomic_write_text(
            RESULTS / f"poison{tag}.md",
            "# Poisoning: 100 fake users promote one item (ML-100K)\n\n"
            "Exposure: share of genuine users who never rated the target with it in their top 10 of the "
            "items they never rated; target percentile: the mean share of those items it outscores "
            "(0.5 = an average item). HR@10 / NDCG@10 on the genuine users.\n\n" + note + markdown(table),
        )


def jobs(seeds: list[int], data_dir: str, rounds: int = ROUNDS, arms: Iterable[str] | None = None) -> list[tuple]:
    """Every job, in priority order: ML-100K FedMF seed 0, the poisoning case (FedMF), then the rest by seed."""
    out = []
    for seed in seeds:
        settings = [(d, m) for d in DATASETS for m in ("FedMF", "FedNCF")]
        settings.sort(key=lambda s: (s[1] != "FedMF", s[0] != "ml-100k"))
        for number, (dataset, model) in enumerate(settings):
            out += [("main", dataset, model, arm, seed, data_dir, rounds) for arm in ARMS]
            if number == 0:
                out += [("poison", "ml-100k", "FedMF", arm, seed, data_dir, rounds) for arm in POISON_ARMS]
    return [job for job in out if arms is None or job[3] in arms]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds per run (the protocol: 100)")
    parser.add_argument("--data-dir", default=os.environ.get("FEDREC_DATA_DIR", ""))
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th job from i")
    parser.add_argument("--arms", default="", help="only these arms (comma-separated; default: all)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.report_only:
        quiet_flower()
        arms = set(args.arms.split(",")) if args.arms else None
        run_jobs(
            jobs([int(s) for s in args.seeds.split(",")], args.data_dir, args.rounds, arms),
            run_job,
            args.shard,
            "flower strategies",
        )
    report(args.rounds)


if __name__ == "__main__":
    main()
