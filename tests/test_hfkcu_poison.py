"""HF-KCU at its defaults on a tiny poisoned federation: fake users push one item; the default unlearning
phase (trust-region CG on the Gauss-Newton matrix, full step) moves the genuine users' ranking of that item toward
where retraining without the fakes puts it, for MF and NCF."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_run_config

from experiments.hfkcu.analysis import exposure, private_records
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.config import RunConfig
from fedrec_flwr.serial import run_serial
from fedrec_flwr.strategies.unlearning import ClientUnlearning, UnlearningSettings

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

GENUINE, FAKES, ITEMS, ROUNDS = 30, 8, 45, 12
TARGET = "i44"


def _poisoned_file(folder):
    """Genuine users like one of three item groups (12 items each); item 44 is rated by two genuine users; each fake
    rates item 44 first and four popular items later (leave-one-out then holds out a filler)."""
    rng = np.random.default_rng(0)
    lines = ["user,item,rating,timestamp"]
    for user in range(GENUINE):
        pool = np.arange(36)[np.arange(36) % 3 == user % 3]
        for t, item in enumerate(rng.choice(pool, size=8, replace=False)):
            lines.append(f"u{user},i{item},5,{1000 + t}")
        if user in (0, 1):
            lines.append(f"u{user},{TARGET},5,{900}")
    for fake in range(FAKES):
        lines.append(f"fake{fake},{TARGET},5,500")
        lines += [f"fake{fake},i{item},5,{600 + j}" for j, item in enumerate((0, 1, 2, 3))]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "poisoned.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def poisoned_setting(folder, model: str):
    """``(mapping, runtime, fakes, target, genuine)`` of the tiny poisoned federation (:func:`_poisoned_file`)."""
    mapping = tiny_run_config(
        folder,
        model=model,
        num_server_rounds=ROUNDS,
        fraction_train=1.0,
        eval_every=ROUNDS,
        learning_rate=0.05,
        users_per_node=10,
    )
    mapping["generic-file"] = str(_poisoned_file(folder))
    runtime = get_runtime(RunConfig.from_mapping(mapping).to_dict())
    split = runtime.split
    fakes = np.flatnonzero([str(u).startswith("fake") for u in split.user_ids]).astype(np.int64)
    target = int(np.flatnonzero(split.item_ids.astype(str) == TARGET)[0])
    return mapping, runtime, fakes, target, np.setdiff1d(np.arange(split.num_users), fakes)


@pytest.mark.parametrize("model", ["mf", "ncf"])
def test_default_phase_moves_the_poisoned_target_toward_the_retrained_model(tmp_path, model):
    mapping, runtime, fakes, target, genuine = poisoned_setting(tmp_path, model)
    split = runtime.split
    assert fakes.size == FAKES and target in split.interacted(int(fakes[0]))
    forget = ",".join(str(int(u)) for u in fakes)

    seen = {}

    def on_round(view):
        if view.server_round != ROUNDS:
            return
        records = private_records(view.grid, genuine)
        seen["original"] = exposure(runtime, records, {k: v.numpy() for k, v in view.arrays.items()}, genuine, target)[
            "target-percentile"
        ]
        config = RunConfig.from_mapping({**mapping, "unlearning": "hfkcu", "forget-users": forget})
        settings = UnlearningSettings.from_config(config, split.num_users)  # the run config's defaults
        assert (settings.krylov_solver, settings.curvature, settings.scale) == ("steihaug", "gauss-newton", 1.0)
        new, report = ClientUnlearning(view.strategy, settings).run(view.grid, view.arrays, view.server_round)
        seen["report"] = report
        seen["unlearned"] = exposure(runtime, records, {k: v.numpy() for k, v in new.items()}, genuine, target)[
            "target-percentile"
        ]

    run_serial(RunConfig.from_mapping(mapping), on_round=on_round)
    retrain_mapping = {**mapping, "unlearning": "retrain", "forget-users": forget, "run-name": "retrain"}
    retrained = {}

    def at_end(view):
        if view.server_round == ROUNDS:
            records = private_records(view.grid, genuine)
            retrained["value"] = exposure(
                runtime, records, {k: v.numpy() for k, v in view.arrays.items()}, genuine, target
            )["target-percentile"]

    run_serial(RunConfig.from_mapping(retrain_mapping), on_round=at_end)
    original, unlearned, reference = seen["original"], seen["unlearned"], retrained["value"]
    print(f"target percentile: original {original:.3f}, unlearned {unlearned:.3f}, retrained {reference:.3f}")
    assert original - reference > 0.1, (original, reference)  # the attack worked
    assert abs(unlearned - reference) < abs(original - reference), (original, unlearned, reference)
    assert unlearned < original
    report = seen["report"]
    assert report["cg-termination"] in ("tolerance", "boundary", "negative-curvature")
    assert not (report["cg-negative-curvature"] and not report["cg-boundary"])  # never a dropped step
