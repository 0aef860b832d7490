"""The calibrated poisoning benchmark: an unlearned model passes when it lands inside the spread of retraining itself.

    python -m experiments.hfkcu.run band --datasets filmtrust --models FedMF --attacks weaker --seeds 0
    python -m experiments.hfkcu.run band --part poisoned ...   # only the poisoned runs (with every method)
    python -m experiments.hfkcu.run band --part retrain ...    # only the retraining seeds
    python -m experiments.hfkcu.run band-report                # recipe.csv / recipe.md from the finished runs

A *setting* is (dataset, model, attack, seed of the poisoned run). Per setting:

* the **poisoned run** (:func:`run_poisoned`): the poisoned federation is trained for
  :data:`~experiments.hfkcu.methods.ROUNDS` rounds; after the last round every method of :data:`METHODS` is applied
  to the trained model (a Flower phase, :class:`fedrec_flwr.strategies.unlearning.ClientUnlearning`; the node states
  are restored after a method that trains) and measured;
* :data:`RETRAIN_SEEDS` **retraining runs** (:func:`run_retrain`): the fakes never sampled, training seeds
  :func:`retrain_seeds`, each measured at :data:`CURVE_ROUNDS` (one run per seed gives the whole curve).

Every model is measured the same way (:func:`measure`) on the genuine users and on the *poisoned run's* split (its
held-out items and 99 test negatives): a retraining seed also draws its own test negatives, so its own evaluation
would add the negatives' noise to the band; here the band holds only training randomness. The 100-round retraining
runs give the **target band** (:func:`band`); :func:`inside_band` judges a method; :func:`cheapest_budget` finds the
fewest retraining rounds whose every seed lands in the band, whose client user-epochs are the denominator of
``cost-ratio``. The data poisoning, the runners' configs, the phases' settings and the analyses are
:mod:`experiments.hfkcu.poison`'s, :mod:`experiments.hfkcu.run`'s and :mod:`experiments.hfkcu.analysis`'s.

Run folders (config, per-round metrics) go to the uncommitted cache; each run's measurements are one small JSON
under ``results/band/``.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.hfkcu.frontier import distance_to_band, plot_frontiers
from experiments.hfkcu.methods import ROUNDS
from fedrec_flwr.io import atomic_write_json, atomic_write_text

# ---------------------------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Attack:
    """A data-poisoning attack: ``fakes`` fake users (or ``fake_share`` of the genuine users, rounded), each rating
    the target and the ``fillers`` most popular items (:func:`experiments.hfkcu.poison.poisoned_data`)."""

    name: str
    fillers: int
    fakes: int | None = None
    fake_share: float | None = None

    def num_fakes(self, genuine_users: int) -> int:
        """Number of fake users for a dataset with ``genuine_users`` users."""
        if self.fakes is not None:
            return int(self.fakes)
        return int(round(float(self.fake_share) * genuine_users))


GENUINE_USERS = {"ml-100k": 943, "filmtrust": 1508}
"""Users in each dataset's raw file (the base of an attack's ``fake_share``)."""

WEAKER = Attack("weaker", fillers=10, fakes=20)
"""Today's smaller attack of :mod:`experiments.hfkcu.poison`: 20 fakes, 10 fillers."""

STRONGER_FIRST = Attack("stronger-first", fillers=30, fake_share=0.25)
"""The stronger attack as first declared, before any run: a quarter of the genuine users as fakes (ML-100K: 236;
FilmTrust: 377), each rating the target and the 30 most popular items. Why this strong: at 100 fakes (10.6% of
ML-100K) with 10 fillers the poisoned FedMF model's exposure@10 is 0 on every ML-100K setting and the target's mean
percentile 0.74 (0.48 at 20 fakes); a linear extrapolation puts the target at a top-30 item's percentile only past
about 250 fakes. The fillers are tripled so that the fakes' embeddings, hence the target's, point along the direction
genuine users share with popular items (a bandwagon attack). Measured on ML-100K FedMF seed 0: exposure@10 still 0
(target percentile 0.871), so it was strengthened once, to :data:`STRONGER`."""

STRONGER = Attack("stronger", fillers=50, fake_share=0.5)
"""The stronger attack of the benchmark, declared after :data:`STRONGER_FIRST` left exposure@10 at 0 on ML-100K
FedMF seed 0 and before this one ran: half the genuine users as fakes (ML-100K: 472; FilmTrust: 754), each rating
the target and the 50 most popular items (the target's percentile rose 0.48 -> 0.74 -> 0.87 with 20 -> 100 -> 236
fakes; doubling the fakes again and widening the bandwagon is the one strengthening allowed)."""

ATTACKS = {attack.name: attack for attack in (WEAKER, STRONGER_FIRST, STRONGER)}

RETRAIN_SEEDS = 5
"""Retraining runs per setting (the fakes never sampled)."""

CURVE_ROUNDS = (10, 25, 50, ROUNDS)
"""Rounds at which each retraining run is measured (its curve); the last is the reference budget."""

BAND_METRICS = ("exposure@10", "HR@10", "NDCG@10")
"""The metrics every one of which must lie inside the band (:func:`inside_band`)."""

MEASURED = ("exposure@10", "target-percentile", "HR@10", "NDCG@10")
"""What :func:`measure` returns; each gets a band."""

BAND_PROTOCOL = {"holdout-validation": True}
"""Keys every run of the benchmark adds to :data:`experiments.hfkcu.methods.PROTOCOL`: each user's second-latest
interaction is held out as a validation item, so that ``unlearning-post-check`` can judge a step without reading the
test item (every model is still measured on the test item)."""

HISTORY = {"unlearning-history": "float32"}
"""Keys the trained (poisoned or forget-set) run adds: the server stores every user's per-round contribution, which
the rollback methods replay (retraining runs store nothing)."""

UNCHECKED = {"unlearning_post_check": "off"}
"""An approximate method measured on its own (the package's ``"auto"`` would check it: every run here holds out a
validation item)."""

METHODS: dict[str, dict] = {
    "HF-KCU": {"method": "hfkcu", **UNCHECKED},
    "HF-KCU, dominated radius": {"method": "hfkcu", "krylov_radius_rule": "dominated", **UNCHECKED},
    "HF-KCU, dominated radius, masked step": {
        "method": "hfkcu",
        "krylov_radius_rule": "dominated",
        "krylov_masked_step": True,
        **UNCHECKED,
    },
    "HF-KCU + post-check": {"method": "hfkcu", "unlearning_post_check": "on"},
    "gradient ascent": {"method": "gradient-ascent", **UNCHECKED},
    "gradient ascent + post-check": {"method": "gradient-ascent", "unlearning_post_check": "on"},
    "continued training (5 rounds)": {"method": "continue"},
    "rollback": {"method": "rollback", "rollback_calibration_every": 0},
    **{
        f"rollback + {n} tuning rounds": {
            "method": "rollback",
            "rollback_calibration_every": 0,
            "rollback_tuning_rounds": n,
        }
        for n in (5, 10, 20)
    },
    "rollback + calibration every 20": {"method": "rollback", "rollback_calibration_every": 20},
    "rollback + calibration every 10": {"method": "rollback", "rollback_calibration_every": 10},
}
"""Unlearning methods applied after the trained run: name -> :class:`~fedrec_flwr.strategies.unlearning.
UnlearningSettings` fields over the run config's defaults (HF-KCU's radius rule ``touched`` and full step unless
named). Every method starts from the same trained model, node states and stored history: the phase's changes to
them are undone before the next (:func:`apply_methods`). A new method is one more entry; the recipe takes every name
a run produced."""

DEV_SEED = 100
"""Seed of the development settings (the stronger attack on both datasets and models), never a reported one: the
retraining seeds 100, 1100, ..., 4100 and the training seed differ from every reported setting's (seeds 0-2)."""

DEV_METHODS = (
    "rollback",
    "rollback + 5 tuning rounds",
    "rollback + 10 tuning rounds",
    "rollback + 20 tuning rounds",
    "rollback + calibration every 20",
)
"""The candidates measured on the development settings (``results/band/dev/``). Rule, fixed before they ran: the
recipe's tuning rounds are the fewest of 0, 5, 10, 20 whose rollback lands inside the band on every development
setting; if none does, the one inside on most, then fewer. FedEraser's calibration (``rollback + calibration every
20``) stays in the recipe only if it lands inside on more development settings than the chosen plain rollback.
Outcome: none lands inside on all four (FilmTrust FedNCF defeats each); 10 tuning rounds on 3 of 4, 0 and 20 on 2,
5 on 1, the calibrated rollback on 2; so the recipe is plain rollback with 10 tuning rounds."""

DEFAULT_METHOD = "rollback + 10 tuning rounds"
"""The default recipe when the run stored its history (its ``default`` column is true): the package's
``unlearning = "auto"`` with ``rollback-tuning-rounds = 10``, chosen on the development settings by the rule of
:data:`DEV_METHODS`. Why tuning and not calibration: plain rollback recomputes every stored aggregate without the
forgotten users exactly, but the remaining users' stored updates were computed on the models the forgotten users
had shaped, and FedNCF's shared MLP replayed that way can lose the ranking (FilmTrust FedNCF, development seed:
HR@10 0.06 after the replay, 0.93 after 10 tuning rounds); calibration rescales the updates' lengths, which does not
repair their directions, while training rounds of the remaining users do. Cost: 10 rounds of the sampled users,
a tenth of the 100-round retraining that is the cheapest landing in the band in most settings. The recipe declared
before any run of the benchmark, FedEraser's calibrated rollback every 20th stored round, stays the arm
``rollback + calibration every 20``."""

RETRAIN_METHOD = "retrain {rounds} rounds"
"""Name of a retraining budget's rows (the poisoned run's own training seed, the fakes never sampled)."""


def retrain_seeds(seed: int, count: int = RETRAIN_SEEDS) -> list[int]:
    """Training seeds of a setting's retraining runs: the poisoned run's own seed first (the usual reference: every
    genuine user trains in the same rounds), then ``seed + 1000 k``."""
    return [int(seed) + 1000 * k for k in range(count)]


# ---------------------------------------------------------------------------------------------- band arithmetic


@dataclass(frozen=True)
class Band:
    """The spread of one metric over the retraining seeds: ``mean +- 2 std`` (``low``, ``high``; ``std`` with
    ``ddof = 1``) and the observed ``min`` / ``max`` of ``n`` values."""

    mean: float
    std: float
    low: float
    high: float
    min: float
    max: float
    n: int

    def contains(self, value: float, tol: float = 1e-12) -> bool:
        """Whether ``value`` lies in ``[low, high]`` (``tol`` absorbs float rounding when ``std = 0``)."""
        return bool(self.low - tol <= float(value) <= self.high + tol)


def band(values: Sequence[float], width: float = 2.0) -> Band:
    """The band of ``values`` (one per retraining seed): ``mean +- width * std``, ``std`` the sample standard
    deviation (``ddof = 1``).

    Why ``mean +- 2 std`` and not ``[min, max]``: with ``n`` seeds and ``ddof = 1`` no value lies farther than
    ``(n - 1) / sqrt(n)`` standard deviations from the mean (Samuelson's inequality: 1.79 for ``n = 5``), so the
    2-sigma band always contains ``[min, max]`` and is the wider of the two; ``[min, max]`` of 5 draws covers on
    average only ``(n - 1) / (n + 1) = 67%`` of the distribution (the expected coverage of the sample range), so a
    sixth retraining seed would fall outside it one time in three. ``mean +- 2 std`` estimates the interval holding
    about 95% of retraining's results (normal approximation).

    Raises:
        ValueError: fewer than two values, or a non-finite one.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2 or not np.all(np.isfinite(x)):
        raise ValueError(f"band: needs at least two finite values, got {values!r}")
    mean, std = float(x.mean()), float(x.std(ddof=1))
    return Band(mean, std, mean - width * std, mean + width * std, float(x.min()), float(x.max()), int(x.size))


def bands(runs: Sequence[Mapping[str, float]], keys: Sequence[str] = MEASURED) -> dict[str, Band]:
    """Metric -> :func:`band` over ``runs`` (one metrics mapping per retraining seed)."""
    return {k: band([run[k] for run in runs]) for k in keys}


def inside_band(
    metrics: Mapping[str, float],
    target: Mapping[str, Band],
    keys: Sequence[str] = BAND_METRICS,
    upper_only: Sequence[str] = (),
) -> bool:
    """Whether every one of ``keys`` of ``metrics`` lies inside its band (``mean +- 2 std``): by default exposure@10
    (the harm), HR@10 and NDCG@10 (the utility; HR@10 alone hides a worse ranking inside the top 10). A key of
    ``upper_only`` (a distance to the reference, such as KL) only has to stay at or below the band's top."""
    return all(
        metrics[k] <= target[k].high + 1e-12 if k in upper_only else target[k].contains(metrics[k]) for k in keys
    )


def cheapest_budget(
    curves: Sequence[Mapping[int, Mapping[str, float]]],
    target: Mapping[str, Band],
    keys: Sequence[str] = BAND_METRICS,
    upper_only: Sequence[str] = (),
) -> int:
    """The fewest rounds ``R`` (of those every curve has) at which every retraining seed's metrics lie inside the
    band: ``curves[s][R]`` is seed ``s``'s metrics after ``R`` rounds. The reference budget (the band's own runs) always
    qualifies when ``target`` is their band with ``n <= 5`` seeds (see :func:`band`).

    Raises:
        ValueError: no curves, or no budget qualifies.
    """
    if not curves:
        raise ValueError("cheapest_budget: no retraining curves")
    budgets = sorted(set.intersection(*(set(int(r) for r in c) for c in curves)))
    for rounds in budgets:
        if all(inside_band(c[rounds], target, keys, upper_only) for c in curves):
            return rounds
    raise ValueError(f"cheapest_budget: no budget of {budgets} lands every seed inside the band")


def cost_ratio(user_epochs: float, budget_user_epochs: float) -> float:
    """A method's client user-epochs over the cheapest retraining budget's (below 1: cheaper than retraining)."""
    if budget_user_epochs <= 0:
        raise ValueError(f"cost_ratio: the budget's user-epochs must be > 0, got {budget_user_epochs}")
    return float(user_epochs) / float(budget_user_epochs)


# ---------------------------------------------------------------------------------------------- cost meter


@dataclass
class Cost:
    """What a stretch of federated work cost: client ``user-epochs`` (a trained user counts its local epochs, a
    queried user one pass over its data, an evaluated user nothing: evaluation is measurement), the arrays' bytes
    sent to and received from the nodes (train and query messages), communication ``rounds`` (server pushes with a
    counted message) and ``seconds`` of wall time."""

    user_epochs: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    seconds: float = 0.0

    def minus(self, other: Cost) -> Cost:
        return Cost(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))

    def as_columns(self) -> dict:
        return {
            "user-epochs": self.user_epochs,
            "bytes-sent": self.bytes_sent,
            "bytes-received": self.bytes_received,
            "rounds": self.rounds,
            "seconds": self.seconds,
        }


class Meter:
    """Counts :class:`Cost` over a run: :meth:`mod` is a Flower client mod (``make_client_app(mods=[meter.mod])``)
    that sees every message a node handles and its reply; :meth:`watch` wraps a grid's ``push_messages`` to count the
    server's pushes. ``local_epochs`` converts a trained user into user-epochs."""

    def __init__(self, local_epochs: int) -> None:
        self.local_epochs = int(local_epochs)
        self.total = Cost()
        self._started = time.perf_counter()
        self._excluded = 0.0
        self._counted_push = False
        self._node_users: dict[int, tuple[int, int]] = {}

    @staticmethod
    def _bytes(content) -> int:
        return sum(len(array.data) for record in content.array_records.values() for array in record.values())

    def mod(self, message, context, call_next):
        reply = call_next(message, context)
        kind = message.metadata.message_type
        if kind.startswith("evaluate"):
            return reply
        self.total.user_epochs += self._users(message, reply, int(getattr(context, "node_id", 0)))
        self.total.bytes_sent += self._bytes(message.content)
        if not reply.has_error():
            self.total.bytes_received += self._bytes(reply.content)
        self._counted_push = True
        return reply

    def _users(self, message, reply, node: int) -> float:
        """User-epochs of one message: a train message's ``users`` times the local epochs; a query naming
        ``users`` one pass each; a query naming the users to ``exclude`` one pass per remaining user of the node (per
        affected user with ``causal``), as its ``unlearn_affected`` reply counted them; the bookkeeping queries
        (``unlearn_affected``, ``unlearn_counts``: index look-ups) none. A local-CG query's inner products are not
        visible here: it counts one pass per user (a lower bound)."""
        from fedrec_flwr.wire import CONFIG, UNLEARN_AFFECTED, UNLEARN_COUNTS

        kind = message.metadata.message_type
        config = message.content.config_records.get(CONFIG)
        if config is None:
            return 0.0
        if kind.endswith(UNLEARN_AFFECTED):
            got = reply.content.config_records.get(CONFIG) if not reply.has_error() else None
            if got is not None:
                self._node_users[node] = (int(got.get("remaining-users", 0)), int(got.get("affected-users", 0)))
            return 0.0
        if kind.endswith(UNLEARN_COUNTS):
            return 0.0
        if "users" in config:
            return float(len(config["users"]) * (self.local_epochs if kind.startswith("train") else 1))
        if "exclude" in config:
            remaining, affected = self._node_users.get(node, (0, 0))
            return float(affected if config.get("causal", False) else remaining)
        return 0.0

    def watch(self, grid) -> None:
        """Count a communication round for every ``push_messages`` call on ``grid`` that delivered a counted message."""
        push = grid.push_messages

        def counted(messages):
            self._counted_push = False
            ids = push(messages)
            self.total.rounds += int(self._counted_push)
            return ids

        grid.push_messages = counted

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (the benchmark's own measurements between rounds) out of the wall time."""
        self._excluded += float(seconds)

    def now(self) -> Cost:
        """The running total, with the wall time since the meter was made less the excluded seconds."""
        return Cost(**{**asdict(self.total), "seconds": time.perf_counter() - self._started - self._excluded})


# ---------------------------------------------------------------------------------------------- measurement


def measure(runtime, records, arrays, users: np.ndarray, target: int) -> dict[str, float]:
    """The benchmark's metrics of one model (shared ``arrays``: key -> array or a Flower ``ArrayRecord``; private
    ``records``) on ``users`` (the genuine ones):
    ``exposure@10`` and ``target-percentile`` (:func:`experiments.hfkcu.analysis.exposure`, ranked among each user's
    never-interacted items) and ``HR@10`` / ``NDCG@10`` of the held-out item among ``runtime``'s 99 test negatives
    (:func:`fedrec_flwr.metrics.ranking_metrics_batch`, ties against the model)."""
    from experiments.hfkcu.analysis import candidate_scores, exposure
    from fedrec_flwr.metrics import mean_metrics, ranking_metrics_batch

    shared = {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v) for k, v in arrays.items()}
    seen = exposure(runtime, records, shared, users, target)
    ranked = mean_metrics(ranking_metrics_batch(candidate_scores(runtime, records, shared, users), 0, ks=(10,)))
    return {
        "exposure@10": seen["exposure"],
        "target-percentile": seen["target-percentile"],
        "HR@10": ranked["HR@10"],
        "NDCG@10": ranked["NDCG@10"],
    }


# ---------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Setting:
    dataset: str
    model: str
    attack: str
    seed: int

    @property
    def folder(self) -> Path:
        return Path(self.dataset) / self.model / self.attack / f"seed-{self.seed}"


def _poisoned(setting: Setting, data_dir: str, cache: Path, seed: int, name: str, runs: Path, **extra):
    """``(config, reference runtime, fake users, target)`` of a run of ``setting``'s poisoned data with training
    ``seed``; the reference runtime is the poisoned run's (``setting.seed``): its split measures every model."""
    from experiments.hfkcu.poison import FAKE_USER_BASE, poisoned_data
    from experiments.hfkcu.run import base_config
    from fedrec_flwr.app.runtime import get_runtime

    attack = ATTACKS[setting.attack]
    fakes = attack.num_fakes(GENUINE_USERS[setting.dataset])
    path, target_raw = poisoned_data(setting.dataset, data_dir, fakes, 0, cache, fillers=attack.fillers)
    generic = {"generic-file": str(path), "generic-columns": "user,item,rating,timestamp"}
    folder = runs / setting.folder
    reference = get_runtime(
        base_config(
            "generic", setting.model, data_dir, folder, "reference", seed=setting.seed, **generic, **BAND_PROTOCOL
        ).to_dict()
    )
    split = reference.split
    fake_users = np.flatnonzero(np.array([int(u) >= FAKE_USER_BASE for u in split.user_ids])).astype(np.int64)
    target = int(np.flatnonzero(split.item_ids.astype(str) == target_raw)[0])
    config = base_config(
        "generic", setting.model, data_dir, folder, name, seed=seed, **generic, **BAND_PROTOCOL, **extra
    )
    return config, reference, fake_users, target


def _train(config, meter: Meter, hooks: Mapping[int, object]) -> None:
    """Train ``config`` in one process with ``meter`` on every node, calling ``hooks[r](view)`` after round ``r``."""
    from fedrec_flwr.app.client_app import make_client_app
    from fedrec_flwr.serial import run_serial

    mapping = config.to_dict()
    shutil.rmtree(Path(config.results_dir) / config.run_name, ignore_errors=True)  # an interrupted run is redone

    def on_round(view) -> None:
        if view.server_round == 1:
            meter.total.rounds += 1  # the first push happened before the grid could be watched
            meter.watch(view.grid)
        if view.server_round in hooks:
            hooks[view.server_round](view)

    run_serial(config, client_app=make_client_app(mapping, mods=[meter.mod]), on_round=on_round)


def apply_methods(view, methods: Mapping[str, dict], forget: np.ndarray, num_users: int, meter: Meter, score) -> dict:
    """Apply every method of ``methods`` to the trained model of ``view`` (an ``on_round`` hook's RoundView) as an
    unlearning phase forgetting ``forget``; ``score(records, arrays, name)`` measures one model with the users'
    private ``records``. Each method starts from the trained model, node states and stored history: a method that
    trains (continued training, calibration, tuning) changes the nodes' states, and a rollback deletes the forgotten
    users' stored contributions, so both are restored after it. Returns name -> ``{"changes", "metrics", "cost",
    "report-seconds", "kept", "why"}`` (``kept`` / ``why``: the post-check's verdict, when the method has one)."""
    from experiments.hfkcu.analysis import private_records
    from experiments.hfkcu.run import _settings
    from fedrec_flwr.strategies.unlearning import ClientUnlearning

    grid, strategy = view.grid, view.strategy
    out: dict = {}
    for name, changes in methods.items():
        settings = _settings(view.config, forget, changes, num_users)
        states = {n: copy.deepcopy(c.state) for n, c in grid.contexts.items()}
        # only a rollback (run directly or as the post-check's fallback) deletes stored contributions; the store is
        # the largest thing the server holds (up to 1.7 GB here), so it is copied only then
        rolls_back = settings.method == "rollback" or settings.unlearning_post_check == "on"
        log = copy.deepcopy(strategy.contribution_log) if rolls_back else strategy.contribution_log
        before = meter.now()
        new, report = ClientUnlearning(strategy, settings, timeout=view.config.round_timeout).run(
            grid, view.arrays, view.server_round
        )
        cost = meter.now().minus(before)
        started = time.perf_counter()
        metrics = score(private_records(grid, range(num_users)), new, name)
        meter.exclude(time.perf_counter() - started)
        got = {"changes": changes, "metrics": metrics, "cost": cost.as_columns()}
        got["report-seconds"] = float(report.get("seconds", float("nan")))
        if "post-check" in report:
            got["kept"] = report["post-check"].get("kept")
            got["why"] = report["post-check"].get("why")
            got["post-check"] = report["post-check"]
        if "history" in report:  # the store's size (per-round detail left out)
            stored = report["history"]
            per_round = list(stored.get("bytes-per-round", {}).values())
            got["history"] = {k: v for k, v in stored.items() if k != "bytes-per-round"}
            got["history"]["bytes-per-round"] = {"mean": float(np.mean(per_round)), "max": float(np.max(per_round))}
        out[name] = got
        print(f"  {name}: {metrics} {cost.as_columns()} {got.get('kept', '')}", flush=True)
        for node, context in grid.contexts.items():
            context.state = states[node]
        strategy.contribution_log = log
    return out


def _pending(done: Path, methods: Mapping[str, dict], add: bool) -> tuple[dict | None, dict]:
    """``(the existing record or None, the methods still to run)`` of a trained run whose record is ``done``: none
    when it exists (all of those it lacks with ``add``)."""
    previous = json.loads(done.read_text()) if done.is_file() else None
    if previous is None:
        return None, dict(methods)
    return previous, ({k: v for k, v in methods.items() if k not in previous["methods"]} if add else {})


def _check_reproduced(done: Path, got: Mapping[str, float], previous: dict | None) -> None:
    """Raise ``RuntimeError`` when a trained run retrained to add methods measures other than its record (NaN equals
    NaN: a membership attack with no score)."""
    if previous is None:
        return
    want = previous["original"]
    same = set(got) == set(want) and all(got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])) for k in got)
    if not same:
        raise RuntimeError(
            f"{done}: the retrained model measures {dict(got)}, the record {want}; the run did not reproduce, "
            "so no method is added"
        )


def _merged(result: dict, previous: dict | None) -> dict:
    """The record to write: ``result``, or ``previous`` with ``result``'s methods added (it keeps its own training
    cost and time)."""
    return result if previous is None else {**previous, "methods": {**previous["methods"], **result["methods"]}}


def run_poisoned(
    setting: Setting,
    *,
    data_dir: str,
    cache: Path,
    out: Path,
    methods: Mapping[str, dict] | None = None,
    add: bool = False,
) -> dict:
    """Train ``setting``'s poisoned federation, then apply and measure every method of ``methods`` (default
    :data:`METHODS`); write and return ``<out>/<setting>/poisoned.json`` (skipped when it exists). With ``add``, an
    existing record gains the methods it lacks: the federation is trained again (the run is deterministic, and the
    retrained model must measure exactly as the recorded one, else ``RuntimeError``) and only those are applied."""
    from experiments.hfkcu.analysis import private_records

    done = out / setting.folder / "poisoned.json"
    previous, methods = _pending(done, METHODS if methods is None else methods, add)
    if not methods:
        print(f"skip (done): {done}", flush=True)
        return {}
    config, reference, fake_users, target = _poisoned(
        setting, data_dir, cache, setting.seed, "poisoned", cache / "band", **HISTORY
    )
    meter = Meter(config.local_epochs)
    result: dict = {"setting": asdict(setting), "fakes": int(fake_users.size), "target": target, "methods": {}}

    def at_end(view) -> None:
        result["train-cost"] = meter.now().as_columns()
        genuine = np.setdiff1d(np.arange(reference.split.num_users), fake_users)
        records = private_records(view.grid, range(reference.split.num_users))
        result["original"] = measure(reference, records, view.arrays, genuine, target)
        print(f"  original {result['original']}", flush=True)
        _check_reproduced(done, result["original"], previous)

        def score(user_records, arrays, name):
            return measure(reference, user_records, arrays, genuine, target)

        result["methods"] = apply_methods(view, methods, fake_users, reference.split.num_users, meter, score)

    started = time.perf_counter()
    _train(config, meter, {ROUNDS: at_end})
    result["wall-seconds"] = time.perf_counter() - started
    result = _merged(result, previous)
    atomic_write_json(done, result)
    return result


def run_retrain(setting: Setting, retrain_seed: int, *, data_dir: str, cache: Path, out: Path) -> dict:
    """Retrain ``setting`` without its fakes with training seed ``retrain_seed``, measuring the model and the cost so
    far at every round of :data:`CURVE_ROUNDS`; write and return ``<out>/<setting>/retrain-seed-<s>.json``."""
    from experiments.hfkcu.analysis import private_records

    done = out / setting.folder / f"retrain-seed-{retrain_seed}.json"
    if done.is_file():
        print(f"skip (done): {done}", flush=True)
        return {}
    config, reference, fake_users, target = _poisoned(
        setting, data_dir, cache, retrain_seed, f"retrain-seed-{retrain_seed}", cache / "band"
    )
    config = config.replace(
        unlearning="retrain", forget_users=",".join(str(int(u)) for u in fake_users), fraction_evaluate=0.0
    )
    meter = Meter(config.local_epochs)
    genuine = np.setdiff1d(np.arange(reference.split.num_users), fake_users)
    result: dict = {"setting": asdict(setting), "retrain-seed": int(retrain_seed), "curve": {}}

    def at(view) -> None:
        cost = meter.now().as_columns()
        started = time.perf_counter()
        metrics = measure(reference, private_records(view.grid, genuine), view.arrays, genuine, target)
        meter.exclude(time.perf_counter() - started)
        result["curve"][str(view.server_round)] = {"metrics": metrics, "cost": cost}
        print(f"  retrain seed {retrain_seed} round {view.server_round}: {metrics} {cost}", flush=True)

    started = time.perf_counter()
    _train(config, meter, {r: at for r in CURVE_ROUNDS})
    result["wall-seconds"] = time.perf_counter() - started
    atomic_write_json(done, result)
    return result


# ---------------------------------------------------------------------------------------------- recipe

RECIPE_COLUMNS = (
    "dataset",
    "model",
    "attack",
    "seed",
    "method",
    "default",
    "inside-band",
    "cost-ratio",
    "exposure@10",
    "target-percentile",
    "HR@10",
    "NDCG@10",
    "user-epochs",
    "bytes-sent",
    "bytes-received",
    "rounds",
    "seconds",
    "cheapest-budget",
    "distance-to-band",
)
"""The recipe's columns, in order (a row may carry more, after these)."""


def recipe_rows(
    poisoned: Mapping,
    retrains: Sequence[Mapping],
    *,
    keys: Sequence[str] = BAND_METRICS,
    measured: Sequence[str] = MEASURED,
    upper_only: Sequence[str] = (),
    target: Mapping[str, Band] | None = None,
    original: str = "poisoned (no unlearning)",
) -> tuple[list[dict], dict]:
    """One setting's recipe rows and its band summary, from :func:`run_poisoned`'s and the :func:`run_retrain` results
    (or the forget-set runs', with their ``keys`` / ``measured`` / ``upper_only``).

    Rows: ``original`` (the trained model, no unlearning), every method the run measured, and every retraining budget
    of :data:`CURVE_ROUNDS` (the run's own seed when it is among the retraining seeds, else the first). The band
    (``target``, default: :func:`bands` of the retraining seeds' 100-round ``measured`` metrics) judges each row on
    ``keys``; ``cost-ratio`` divides by the user-epochs (mean over seeds) of :func:`cheapest_budget`. The summary holds
    each metric's band and its width against the min-max range."""
    setting = poisoned["setting"]
    curves = [{int(r): point["metrics"] for r, point in run["curve"].items()} for run in retrains]
    costs = [{int(r): point["cost"] for r, point in run["curve"].items()} for run in retrains]
    final = max(CURVE_ROUNDS)
    target = bands([c[final] for c in curves], measured) if target is None else target
    budget = cheapest_budget(curves, target, keys, upper_only)
    budget_user_epochs = float(np.mean([c[budget]["user-epochs"] for c in costs]))
    base = {k: setting[k] for k in ("dataset", "model", "attack", "seed")}

    def row(method: str, metrics: Mapping, cost: Mapping | None) -> dict:
        ratio = cost_ratio(cost["user-epochs"], budget_user_epochs) if cost else float("nan")
        return {
            **base,
            "method": method,
            "default": method == DEFAULT_METHOD,
            "inside-band": inside_band(metrics, target, keys, upper_only),
            "cost-ratio": ratio,
            "distance-to-band": distance_to_band(metrics, target, keys, upper_only),
            **{k: metrics[k] for k in measured},
            **(
                {k: cost[k] for k in ("user-epochs", "bytes-sent", "bytes-received", "rounds", "seconds")}
                if cost
                else {}
            ),
            "cheapest-budget": budget,
        }

    rows = [row(original, poisoned["original"], None)]
    for name, got in poisoned["methods"].items():  # a post-checked method says whose result the run kept
        rows.append({**row(name, got["metrics"], got["cost"]), **({"kept": got["kept"]} if "kept" in got else {})})
    own = next((i for i, run in enumerate(retrains) if run["retrain-seed"] == setting["seed"]), 0)
    for rounds in sorted(curves[own]):
        rows.append(row(RETRAIN_METHOD.format(rounds=rounds), curves[own][rounds], costs[own][rounds]))
    stored = next((got["history"] for got in poisoned["methods"].values() if "history" in got), None)
    summary = {
        **base,
        **({"history": stored} if stored else {}),
        "retrain-seeds": [run["retrain-seed"] for run in retrains],
        "cheapest-budget": budget,
        "budget-user-epochs": budget_user_epochs,
        "bands": {k: asdict(b) for k, b in target.items()},
        "band-over-range": {
            k: (b.high - b.low) / (b.max - b.min) if b.max > b.min else float("inf") for k, b in target.items()
        },
    }
    return rows, summary


def recipe_frame(rows: Sequence[Mapping]) -> pd.DataFrame:
    """The rows as a frame with :data:`RECIPE_COLUMNS` first (missing ones empty)."""
    frame = pd.DataFrame(list(rows))
    for column in RECIPE_COLUMNS:
        if column not in frame:
            frame[column] = np.nan
    return frame[list(RECIPE_COLUMNS) + [c for c in frame.columns if c not in RECIPE_COLUMNS]]


COST_TARGET = 0.2
"""The default recipe's cost target: at most a fifth of the cheapest retraining that lands in the band."""


SETTING_KEYS = ["dataset", "model", "attack", "seed"]


def count_lines(frame: pd.DataFrame, harmed: pd.DataFrame | None = None) -> list[str]:
    """``"<method>: inside band in N of M settings"`` (and, for a method with a cost, in how many of those at
    ``cost-ratio`` <= :data:`COST_TARGET`; with ``harmed``, the settings whose untouched model lies outside the band,
    in how many of those), the default method first, then the others by name."""
    names = sorted(frame["method"].unique(), key=lambda m: (m != DEFAULT_METHOD, m))
    keys = set(map(tuple, harmed[SETTING_KEYS].itertuples(index=False))) if harmed is not None else set()
    lines = []
    for name in names:
        rows = frame[frame["method"] == name]
        line = f"{name}: inside band in {int(rows['inside-band'].sum())} of {len(rows)} settings"
        if "cost-ratio" in rows and rows["cost-ratio"].notna().any() and not name.startswith("retrain "):
            cheap = rows["inside-band"] & (rows["cost-ratio"] <= COST_TARGET + 1e-12)
            line += f" ({int(cheap.sum())} at cost-ratio <= {COST_TARGET}"
            if harmed is not None:
                hit = np.array([tuple(r) in keys for r in rows[SETTING_KEYS].itertuples(index=False)], dtype=bool)
                line += f"; {int(cheap[hit].sum())} of the {int(hit.sum())} harmed"
            line += f"; median cost-ratio {rows['cost-ratio'].median():.3g})"
        lines.append(line)
    return lines


def _cell(value) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, float) and math.isnan(value):
        return ""
    if isinstance(value, (float, np.floating)):
        return f"{value:.4g}"
    return str(value)


def write_recipe(rows: Sequence[Mapping], summaries: Sequence[Mapping], folder: Path) -> pd.DataFrame:
    """Write ``recipe.csv``, ``recipe.md`` (the table, the count lines and each setting's band) and
    ``recipe-bands.json`` under ``folder``; return the frame."""
    frame = recipe_frame(rows)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "recipe.csv", frame.to_csv(index=False))
    atomic_write_json(folder / "recipe-bands.json", list(summaries))
    shown = [c for c in RECIPE_COLUMNS if c in frame]
    untouched = frame[frame["method"].str.endswith("(no unlearning)")]
    judged = frame[~frame["method"].str.endswith("(no unlearning)")]
    forget = judged["attack"].str.startswith("forget-")
    harmless = untouched[~untouched["attack"].str.startswith("forget-")]
    lines = [
        "# Calibrated unlearning benchmark: recipe (generated by `python -m experiments.hfkcu.run band-report`)",
        "",
        "A poisoning row (attack `weaker` / `stronger`) is *inside band* when exposure@10, HR@10 and NDCG@10 of the "
        "genuine users all lie within mean +- 2 std of the retraining seeds' 100-round models; a random forget set's "
        "row (`forget-1%`, `forget-5%`) when membership AUC, HR@10 and NDCG@10 do and its KL to the reference "
        "retrained model stays at or below the other seeds' mean + 2 std (`experiments/hfkcu/band.py`). "
        "`cost-ratio`: the method's client user-epochs over those of the cheapest retraining budget whose every seed "
        "lands in that band (`cheapest-budget`, rounds). Retraining rows: the trained run's own seed.",
        "",
        *(
            ["Poisoning:", ""]
            + [f"- {line}" for line in count_lines(judged[~forget], harmless[~harmless["inside-band"]])]
            + [
                f"- poisoned (no unlearning): inside band in {int(harmless['inside-band'].sum())} of {len(harmless)} "
                "settings (there the attack did no harm the band can see, and every method that leaves the model "
                "alone passes); the others are the *harmed* settings",
                "",
            ]
            if (~forget).any()
            else []
        ),
        *(
            ["Random forget sets:", ""] + [f"- {line}" for line in count_lines(judged[forget])] + [""]
            if forget.any()
            else []
        ),
        "",
        "| " + " | ".join(shown) + " |",
        "|" + "---|" * len(shown),
        *["| " + " | ".join(_cell(v) for v in row) + " |" for row in frame[shown].itertuples(index=False)],
        "",
        "## Bands (retraining seeds, 100 rounds)",
        "",
        "| dataset | model | attack | seed | metric | mean | std | mean - 2 std | mean + 2 std | min | max | "
        "2-sigma width / range |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        for k, b in s["bands"].items():
            lines.append(
                f"| {s['dataset']} | {s['model']} | {s['attack']} | {s['seed']} | {k} | {b['mean']:.4f} | "
                f"{b['std']:.4f} | {b['low']:.4f} | {b['high']:.4f} | {b['min']:.4f} | {b['max']:.4f} | "
                f"{_cell(float(s['band-over-range'][k]))} |"
            )
    lines += history_lines(summaries)
    atomic_write_text(folder / "recipe.md", "\n".join(lines) + "\n")
    plot_frontiers(frame, folder / "frontier", DEFAULT_METHOD)
    return frame


def history_lines(summaries: Sequence[Mapping]) -> list[str]:
    """``recipe.md``'s table of what the stored history (``unlearning-history = "float32"``) cost the server per
    setting: users stored, rounds, total MB, MB per round (mean and largest), kB per user over the run (mean and
    largest); empty when no setting stored one."""
    rows = [s for s in summaries if s.get("history")]
    if not rows:
        return []
    lines = [
        "",
        '## Stored history (server memory of `unlearning-history = "float32"`)',
        "",
        "| dataset | model | attack | seed | users | rounds | MB | MB per round (mean / max) | kB per user (mean / max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        h = s["history"]
        per_round, per_user = h.get("bytes-per-round", {}), h.get("bytes-per-user", {})
        lines.append(
            f"| {s['dataset']} | {s['model']} | {s['attack']} | {s['seed']} | {h.get('users', '')} | "
            f"{h.get('rounds', '')} | {h['bytes'] / 1e6:.1f} | {per_round.get('mean', 0) / 1e6:.2f} / "
            f"{per_round.get('max', 0) / 1e6:.2f} | {per_user.get('mean', 0) / 1e3:.0f} / {per_user.get('max', 0) / 1e3:.0f} |"
        )
    return lines


def report(out: Path, folder: Path, cache: Path | None = None) -> pd.DataFrame | None:
    """The recipe of every setting under ``out`` with a ``poisoned.json`` (or a forget set's ``trained.json``, whose
    KL needs the candidate scores in ``cache``) and at least two retraining runs."""
    rows, summaries = [], []
    for done in sorted(out.rglob("poisoned.json")):
        retrains = [json.loads(p.read_text()) for p in sorted(done.parent.glob("retrain-seed-*.json"))]
        if len(retrains) < 2:
            continue
        got, summary = recipe_rows(json.loads(done.read_text()), retrains)
        rows += got
        summaries.append(summary)
    for done in sorted(out.rglob("trained.json")) if cache is not None else ():
        retrains = [json.loads(p.read_text()) for p in sorted(done.parent.glob("retrain-seed-*.json"))]
        if len(retrains) < 3:
            continue
        got, summary = forget_rows(json.loads(done.read_text()), retrains, cache)
        rows += got
        summaries.append(summary)
    return write_recipe(rows, summaries, folder) if rows else None


# ---------------------------------------------------------------------------------------------- random forget sets

FORGET_MEASURED = ("mia-auc", "kl", "HR@10", "NDCG@10")
"""A forget set's metrics: membership AUC on the forgotten users, KL to the reference retrained model's candidate
distribution, HR@10 / NDCG@10 of the remaining users."""

FORGET_UPPER_ONLY = ("kl",)
"""KL is a distance to the reference: a model need only stay at or below the band's top."""


def forget_setting(dataset: str, model: str, forget: str, seed: int) -> Setting:
    """A random forget set (``"1%"`` / ``"5%"`` of :data:`experiments.hfkcu.methods.FORGET_SETS`, drawn with the
    training ``seed`` as :mod:`experiments.hfkcu.run`'s ``forget`` part draws it) as a setting whose attack reads
    ``forget-1%``."""
    return Setting(dataset, model, f"forget-{forget}", int(seed))


def _forget(setting: Setting, data_dir: str, cache: Path, seed: int, name: str, **extra):
    """``(config, reference runtime, forgotten users, remaining users)`` of a run of a forget setting with training
    ``seed`` (the reference runtime and the forget set are the trained run's, ``setting.seed``)."""
    from experiments.hfkcu.run import base_config, forget_sets
    from fedrec_flwr.app.runtime import get_runtime

    folder = cache / "band" / setting.folder
    reference = get_runtime(
        base_config(
            setting.dataset, setting.model, data_dir, folder, "reference", seed=setting.seed, **BAND_PROTOCOL
        ).to_dict()
    )
    forgotten = forget_sets(reference.split.num_users, setting.seed)[setting.attack.removeprefix("forget-")]
    remaining = np.setdiff1d(np.arange(reference.split.num_users), forgotten)
    config = base_config(setting.dataset, setting.model, data_dir, folder, name, seed=seed, **BAND_PROTOCOL, **extra)
    return config, reference, forgotten, remaining


def measure_forget(runtime, records, forgotten_records, arrays, forgotten, remaining, seed: int):
    """``(metrics, candidate scores)`` of one model on a forget set: membership AUC of the ``forgotten`` users with
    their trained embeddings ``forgotten_records`` (:func:`experiments.hfkcu.analysis.membership`, as the ``forget``
    report scores it), HR@10 / NDCG@10 of the ``remaining`` users with ``records``, and their ``(len(remaining),
    100)`` test-candidate logits (for the KL, computed by the report against the reference retrained model)."""
    from experiments.hfkcu.analysis import candidate_scores, membership
    from fedrec_flwr.metrics import mean_metrics, ranking_metrics_batch

    shared = {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v) for k, v in arrays.items()}
    scores = candidate_scores(runtime, records, shared, remaining)
    ranked = mean_metrics(ranking_metrics_batch(scores, 0, ks=(10,)))
    try:
        auc = membership(runtime, forgotten_records, shared, forgotten, seed)["auc"]
    except ValueError:  # a diverged model: no attack to score
        auc = float("nan")
    return {"mia-auc": auc, "HR@10": ranked["HR@10"], "NDCG@10": ranked["NDCG@10"]}, scores.astype(np.float32)


def _scores_path(cache: Path, setting: Setting, name: str) -> Path:
    return cache / "band-scores" / setting.folder / f"{name}.npy"


def run_forget_trained(
    setting: Setting,
    *,
    data_dir: str,
    cache: Path,
    out: Path,
    methods: Mapping[str, dict] | None = None,
    add: bool = False,
) -> dict:
    """Train a forget setting's federation and apply every method (as :func:`run_poisoned`, ``add`` included); write
    ``trained.json`` (metrics and costs), the forgotten users' trained records and every model's candidate scores
    (cache)."""
    from experiments.hfkcu.analysis import private_records
    from fedrec_flwr.io import atomic_save_npz

    done = out / setting.folder / "trained.json"
    previous, methods = _pending(done, METHODS if methods is None else methods, add)
    if not methods:
        print(f"skip (done): {done}", flush=True)
        return {}
    config, reference, forgotten, remaining = _forget(setting, data_dir, cache, setting.seed, "trained", **HISTORY)
    meter = Meter(config.local_epochs)
    result: dict = {"setting": asdict(setting), "forgotten": int(forgotten.size), "methods": {}}

    def at_end(view) -> None:
        result["train-cost"] = meter.now().as_columns()
        grid = view.grid
        records = private_records(grid, range(reference.split.num_users))
        mine = {int(u): records[int(u)] for u in forgotten if int(u) in records}
        atomic_save_npz(
            cache / "band-scores" / setting.folder / "forgotten-records.npz",
            **{f"{u}/{k}": v.numpy() for u, rec in mine.items() for k, v in rec.items()},
        )
        metrics, scores = measure_forget(reference, records, mine, view.arrays, forgotten, remaining, setting.seed)
        np.save(_scores_path(cache, setting, "original"), scores)
        result["original"] = metrics
        _check_reproduced(done, metrics, previous)

        def score(user_records, arrays, name):
            got, scores = measure_forget(reference, user_records, mine, arrays, forgotten, remaining, setting.seed)
            np.save(_scores_path(cache, setting, slug_name(name)), scores)
            return got

        result["methods"] = apply_methods(view, methods, forgotten, reference.split.num_users, meter, score)

    started = time.perf_counter()
    _scores_path(cache, setting, "x").parent.mkdir(parents=True, exist_ok=True)
    _train(config, meter, {ROUNDS: at_end})
    result["wall-seconds"] = time.perf_counter() - started
    result = _merged(result, previous)
    atomic_write_json(done, result)
    return result


def run_forget_retrain(setting: Setting, retrain_seed: int, *, data_dir: str, cache: Path, out: Path) -> dict:
    """Retrain a forget setting without its forgotten users with training seed ``retrain_seed`` (after
    :func:`run_forget_trained`: membership inference uses the forgotten users' trained embeddings), measured at
    :data:`CURVE_ROUNDS`; write ``retrain-seed-<s>.json`` and the candidate scores (cache)."""
    from flwr.app import Array, ArrayRecord

    from experiments.hfkcu.analysis import private_records

    done = out / setting.folder / f"retrain-seed-{retrain_seed}.json"
    if done.is_file():
        print(f"skip (done): {done}", flush=True)
        return {}
    config, reference, forgotten, remaining = _forget(
        setting,
        data_dir,
        cache,
        retrain_seed,
        f"retrain-seed-{retrain_seed}",
    )
    config = config.replace(
        unlearning="retrain", forget_users=",".join(str(int(u)) for u in forgotten), fraction_evaluate=0.0
    )
    grouped: dict[int, dict] = {}
    with np.load(cache / "band-scores" / setting.folder / "forgotten-records.npz") as data:
        for key in data.files:
            user, name = key.split("/", 1)
            grouped.setdefault(int(user), {})[name] = Array(data[key])
    mine = {u: ArrayRecord(v) for u, v in grouped.items()}
    meter = Meter(config.local_epochs)
    result: dict = {"setting": asdict(setting), "retrain-seed": int(retrain_seed), "curve": {}}

    def at(view) -> None:
        cost = meter.now().as_columns()
        started = time.perf_counter()
        records = private_records(view.grid, remaining)
        metrics, scores = measure_forget(reference, records, mine, view.arrays, forgotten, remaining, setting.seed)
        np.save(_scores_path(cache, setting, f"retrain-seed-{retrain_seed}-round-{view.server_round}"), scores)
        meter.exclude(time.perf_counter() - started)
        result["curve"][str(view.server_round)] = {"metrics": metrics, "cost": cost}
        print(f"  retrain seed {retrain_seed} round {view.server_round}: {metrics} {cost}", flush=True)

    started = time.perf_counter()
    _train(config, meter, {r: at for r in CURVE_ROUNDS})
    result["wall-seconds"] = time.perf_counter() - started
    atomic_write_json(done, result)
    return result


def slug_name(name: str) -> str:
    from experiments.common import slug

    return slug(name)


def forget_rows(trained: Mapping, retrains: Sequence[Mapping], cache: Path) -> tuple[list[dict], dict]:
    """A forget setting's recipe rows: every model's KL to the reference retrained model (the trained run's own seed,
    100 rounds; :func:`experiments.hfkcu.analysis.mean_kl`) is added to its metrics; KL's band is over the *other*
    retraining seeds (the reference's own KL is 0 by definition), the others' over every seed."""
    from experiments.hfkcu.analysis import mean_kl

    setting = Setting(**trained["setting"])
    final = max(CURVE_ROUNDS)
    own = next((r for r in retrains if r["retrain-seed"] == setting.seed), retrains[0])
    reference = np.load(_scores_path(cache, setting, f"retrain-seed-{own['retrain-seed']}-round-{final}"))

    def kl(name: str) -> float:
        return mean_kl(np.load(_scores_path(cache, setting, name)).astype(np.float64), reference.astype(np.float64))

    trained = copy.deepcopy(dict(trained))
    trained["original"] = {**trained["original"], "kl": kl("original")}
    for name, got in trained["methods"].items():
        got["metrics"] = {**got["metrics"], "kl": kl(slug_name(name))}
    retrains = copy.deepcopy(list(retrains))
    for run in retrains:
        for rounds, point in run["curve"].items():
            point["metrics"] = {**point["metrics"], "kl": kl(f"retrain-seed-{run['retrain-seed']}-round-{rounds}")}
    others = [r["curve"][str(final)]["metrics"] for r in retrains if r["retrain-seed"] != own["retrain-seed"]]
    target = bands([r["curve"][str(final)]["metrics"] for r in retrains], ("mia-auc", "HR@10", "NDCG@10"))
    target["kl"] = band([m["kl"] for m in others])
    return recipe_rows(
        trained,
        retrains,
        keys=FORGET_MEASURED,
        measured=FORGET_MEASURED,
        upper_only=FORGET_UPPER_ONLY,
        target=target,
        original="trained (no unlearning)",
    )
