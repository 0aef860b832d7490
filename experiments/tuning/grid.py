"""The tuning protocol, declared once: methods, the grid of rates per method, budgets, seeds.

Every method starts from its configuration in :mod:`experiments.fedrecgel.methods` (the main table's) and the same
protocol (leave-one-out, 99 sampled negatives, a validation item held out of training for everyone, 10% of users per
round, one local epoch, every user evaluated every 10 rounds on the test and the validation item). The grid is
searched per dataset at :data:`GRID_SEED` for :data:`GRID_ROUNDS` rounds; the setting with the best validation HR@10
at the last round (:mod:`experiments.tuning.selection`) is then run with every seed of :data:`SEEDS`, for
:data:`GRID_ROUNDS` (the grid's own run is seed 0's) and for :data:`LONG_ROUNDS` rounds.

A grid is a list of *stages*: each stage varies its keys over their values with the keys of earlier stages fixed at
their selected values (a coordinate search; ours, to fit FedRecGEL's 2-D grid into the time budget); the previous
stage's winner (the incumbent) competes in the next stage too, so a later stage can only keep or improve the
validation score. A one-stage method with several keys in its stage runs their full product.
"""

from __future__ import annotations

from experiments.fedrecgel.methods import METHODS as BASE_METHODS
from experiments.fedrecgel.methods import PROTOCOL as BASE_PROTOCOL

GRID_ROUNDS = 100
LONG_ROUNDS = 300
GRID_SEED = 0
SEEDS = (0, 1, 2)

PROTOCOL = {**BASE_PROTOCOL, "num-server-rounds": GRID_ROUNDS, "users-per-node": 1000}
"""FedRecGEL's Table 2 protocol; ``users-per-node = 1000`` puts every user of a dataset on one node, so a round's
sampled users train as one vectorized block (``block-training = auto``, :mod:`fedrec_flwr.local.blocks`; same updates as
one user per node up to float summation order, tested in ``tests/test_blocks.py``). PFedRec has no block path and
runs its users one after another either way."""

EVAL_EVERY: dict[str, int] = {"amazon-video": 50}
"""The evaluation interval of a dataset's federated runs where it is not the protocol's 10 rounds. Amazon-Video ranks
for all 8,072 users on two items at every evaluation (about 4 training rounds' time there); every 50 rounds keeps
the rounds the protocol reads (100 and 300) and does not change training: users are drawn from (seed, round),
whatever the evaluation schedule (``tests/test_tuning_presets.py::test_a_sparser_evaluation_schedule_trains_the_same_model``).
Its curves have 50-round resolution."""

METHODS: dict[str, dict] = {
    "FedMF": BASE_METHODS["FedMF"],
    "FedNCF": BASE_METHODS["FedNCF"],
    "PFedRec": BASE_METHODS["PFedRec"],
    "FedRecGEL": BASE_METHODS["FedRecGEL"],
    # SAM switched off (rho 0 on both groups), everything else FedRecGEL's: gradient upload, server Adam, private
    # Adam 0.1 of the user embedding. Tuned on the same server-rate grid, so "does SAM help" is asked at tuned rates.
    "FedRecGEL w/o SAM": {**BASE_METHODS["FedRecGEL"], "rho-shared": 0.0, "rho-private": 0.0},
}

SERVER_RATES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.0003)
"""The protocol's {0.001, 0.003, 0.01, 0.03}, 0.1 because 0.03 was the best at the edge (FedRecGEL w/o SAM on
ML-100K), and 0.0003 because 0.001 was the best at the lower edge (FedRecGEL and FedRecGEL w/o SAM on Amazon-Video;
run on Amazon-Video only, where 0.001 won: on the other datasets 0.001 is far below the choice)."""

GRIDS: dict[str, list[dict[str, tuple]]] = {
    # the local Adam rate (the shared one of every parameter); values ordered so the default runs first
    # (0.3 and 1.0 because each was the best so far, at the edge of the grid)
    # (0.001: 0.003 was the best on FilmTrust, at the edge)
    "FedMF": [{"learning-rate": (0.01, 0.03, 0.1, 0.3, 0.003, 1.0, 0.001)}],
    # 0.1: 0.03 was the best on ML-100K, at the edge; 0.001: 0.003 was the best on FilmTrust, at the edge
    "FedNCF": [{"learning-rate": (0.01, 0.03, 0.003, 0.1, 0.001)}],
    # PFedRec's score-function SGD rate; its item rate follows it (item-learning-rate 0: lr * items * 80, its paper's)
    # (few values: PFedRec has no block path and one run costs about 5 minutes here; 0.03 and 0.01 because 0.1 was
    # chosen at the lower edge on ML-100K and FilmTrust, where 0.3 diverged; 0.003 because Lastfm-2K then chose 0.01,
    # the new edge; not run on ML-100K and FilmTrust, where 0.01 is below 0.1; 0.001 because Lastfm-2K chose 0.003,
    # again the edge; run on Lastfm-2K only; 0.0003 because Lastfm-2K and Amazon-Video chose 0.001, again the edge;
    # run on those two only; 0.0001 because both then chose 0.0003, again the edge)
    "PFedRec": [{"learning-rate": (0.1, 0.03, 0.01, 0.3, 0.003, 0.001, 0.0003, 0.0001)}],
    # server Adam rate at the public rho 0.05, then rho-shared in {0.02, 0.05, 0.1} at the chosen rate (rho-private
    # stays 0.05; rho 0 on both is the "w/o SAM" method, tuned on its own); the client's private Adam 0.1 is the
    # public code's, not tuned (time: one FedRecGEL run costs about 4 minutes here)
    "FedRecGEL": [{"server-learning-rate": SERVER_RATES}, {"rho-shared": (0.02, 0.1)}],
    "FedRecGEL w/o SAM": [{"server-learning-rate": SERVER_RATES}],
}


PRESETS: dict[str, tuple[str, dict]] = {
    # FedRecGEL's public code's NCF (models/fedrecgel.py with its defaults factor_num = 32, num_layers = 3): 32-wide
    # GMF embeddings, 128-wide MLP embeddings, a 256-128-64-32 tower (Linear(2 x 128, 128), (128, 64), (64, 32)),
    # output Linear(32 + 32, 1); and its final configuration's rho 0.02 (rho-shared; rho-private stays the base's).
    "FedRecGEL, public NCF": (
        "FedRecGEL",
        {"embedding-dim": 32, "mlp-embedding-dim": 128, "mlp-layers": "128,64,32", "rho-shared": 0.02},
    ),
}
"""Named variants of a tuned method, run beside it: ``name -> (base method, overrides)``. A preset is not tuned: it
runs at its base method's rates selected on the dataset's validation item (:func:`preset_setting`), with its own
keys on top, for every seed of :data:`SEEDS`, so the two are compared paired by seed."""


def method_config(method: str) -> dict:
    """The run-config overrides of a method of :data:`METHODS` or a preset of :data:`PRESETS` (its base method's,
    then the preset's keys). Raises ``KeyError`` naming the known ones for any other name."""
    if method in METHODS:
        return METHODS[method]
    if method in PRESETS:
        base, keys = PRESETS[method]
        return {**METHODS[base], **keys}
    raise KeyError(f"unknown method or preset {method!r}; known: {sorted(METHODS) + sorted(PRESETS)}")


def preset_setting(preset: str, selected: dict) -> dict:
    """The setting (folder name) of a preset's runs: its base method's selected setting ``selected``, with the
    preset's value of any key that setting varies (e.g. ``rho-shared``); the preset's other keys (the architecture)
    are in :func:`method_config`."""
    keys = PRESETS[preset][1]
    return {**selected, **{k: v for k, v in keys.items() if k in selected}}


def default_setting(method: str) -> dict:
    """The method's base values of every key its grid varies (the starting point of the coordinate search)."""
    keys = [k for stage in GRIDS[method] for k in stage]
    return {k: METHODS[method][k] for k in keys}


def stage_settings(method: str, stage: int, fixed: dict) -> list[dict]:
    """The settings of one stage: ``fixed`` (earlier stages' selections and the base values) with this stage's keys
    over the product of their values, in declaration order; from the second stage on, ``fixed`` itself (the
    incumbent, already run in an earlier stage) comes first unless a listed value equals it, so it competes and wins
    a full tie. A setting already run in an earlier stage appears again (the caller skips finished runs by name)."""
    import itertools

    keys = list(GRIDS[method][stage])
    out = []
    for values in itertools.product(*(GRIDS[method][stage][k] for k in keys)):
        out.append({**fixed, **dict(zip(keys, values))})
    if stage > 0 and setting_name(fixed) not in {setting_name(s) for s in out}:
        out.insert(0, dict(fixed))
    return out


def setting_name(setting: dict) -> str:
    """A stable folder name for a setting, e.g. ``learning-rate=0.01`` or ``rho-shared=0.05,server-learning-rate=0.01``."""
    return ",".join(f"{k}={setting[k]:g}" for k in sorted(setting))


def run_overrides(method: str, setting: dict, dataset: str, seed: int, rounds: int) -> dict:
    """The complete run-config overrides of one run (the protocol, the method, the setting)."""
    every = {"eval-every": EVAL_EVERY[dataset]} if dataset in EVAL_EVERY else {}
    return {
        **PROTOCOL,
        **every,
        **method_config(method),
        **setting,
        "dataset": dataset,
        "seed": seed,
        "num-server-rounds": rounds,
    }
