"""The eps of the FedAU² experiments is chosen on the validation item by a fixed rule
(``experiments.fedau2.report.select_epsilon``): among the eps whose gender attacker AUCs are both within 0.05 of 0.5,
the highest validation HR@10; the test item's HR@10 plays no part."""

from __future__ import annotations

import json

from experiments.fedau2.report import select_epsilon


def _run(root, model, eps, val_hr, test_hr, auc_lr, auc_mlp, seed=3):
    folder = root / "runs" / "select-eps" / model / f"eps{eps}-seed{seed}"
    folder.mkdir(parents=True)
    client = "fedrec" if eps == 0 else "fedau2"
    (folder / "config.json").write_text(
        json.dumps({"run-config": {"seed": seed, "client": client, "adversary-epsilon": eps or 1.0}})
    )
    (folder / "summary.json").write_text(
        json.dumps({"final": {"HR@10": test_hr, "val-HR@10": val_hr, "val-NDCG@10": val_hr / 2}})
    )
    (folder / "attack.json").write_text(
        json.dumps({"attribute-inference": {"gender/logreg": {"auc": auc_lr}, "gender/mlp": {"auc": auc_mlp}}})
    )


def test_the_in_band_eps_with_the_best_validation_hr_is_chosen_whatever_the_test_hr(tmp_path):
    _run(tmp_path, "FedNCF", 0, 0.54, 0.52, 0.65, 0.63)
    _run(tmp_path, "FedNCF", 0.03, 0.545, 0.60, 0.60, 0.58)  # best validation and test HR, but leaks: not chosen
    _run(tmp_path, "FedNCF", 0.1, 0.53, 0.4321, 0.52, 0.54)  # in the band, best validation HR of those: chosen
    _run(tmp_path, "FedNCF", 0.3, 0.52, 0.6111, 0.49, 0.51)  # in the band, the best test HR: not chosen
    _run(tmp_path, "FedMF", 0, 0.40, 0.40, 0.60, 0.60)
    _run(tmp_path, "FedMF", 0.1, 0.41, 0.40, 0.58, 0.52)  # no eps in the band: the closest is chosen
    _run(tmp_path, "FedMF", 1.0, 0.39, 0.40, 0.56, 0.55)
    table = select_epsilon(tmp_path)
    chosen = table[table["chosen"]].set_index("model")["epsilon"].to_dict()
    assert chosen == {"FedNCF": 0.1, "FedMF": 1.0}
    text = (tmp_path / "select-eps.md").read_text()
    assert "0.4321" not in text and "0.6111" not in text  # no test HR@10 in the selection table
    assert (
        abs(table.set_index(["model", "epsilon"]).loc[("FedNCF", 0.1), "val-HR@10-change-%"] - 100 * (0.53 / 0.54 - 1))
        < 1e-9
    )


def test_age_is_chosen_on_age_aucs_against_the_shared_original_run(tmp_path):
    """``select-eps --attributes age``: the arm's runs are trained against age and read on age's AUCs; the original
    model's single run is the reference row of both attributes (it is attacked on each)."""

    def run(name, eps, val_hr, gender_aucs, age_aucs, attribute=None, step=None):
        folder = tmp_path / "runs" / "select-eps" / "FedNCF" / name
        folder.mkdir(parents=True)
        config = {"seed": 3, "client": "fedrec" if eps == 0 else "fedau2", "adversary-epsilon": eps or 1.0}
        if attribute:
            config["protected-attribute"] = attribute
        if step:
            config["adversary-embedding-optimizer"] = step
        (folder / "config.json").write_text(json.dumps({"run-config": config}))
        (folder / "summary.json").write_text(
            json.dumps({"final": {"HR@10": 0.5, "val-HR@10": val_hr, "val-NDCG@10": val_hr / 2}})
        )
        inference = {
            f"{a}/{c}": {"auc": v}
            for a, aucs in (("gender", gender_aucs), ("age", age_aucs))
            for c, v in zip(("logreg", "mlp"), aucs)
        }
        (folder / "attack.json").write_text(json.dumps({"attribute-inference": inference}))

    run("original", 0, 0.54, (0.65, 0.63), (0.64, 0.60))
    run("gender-0.1", 0.1, 0.53, (0.49, 0.54), (0.60, 0.60), "gender")  # gender: in the band, chosen
    run("age-0.1", 0.1, 0.535, (0.52, 0.52), (0.56, 0.56), "age")  # in gender's band, not age's: not chosen
    run("age-0.3", 0.3, 0.52, (0.70, 0.70), (0.54, 0.53), "age")  # age in the band: chosen
    run("age-sgd-10", 10, 0.53, (0.60, 0.60), (0.53, 0.54), "age", "sgd")  # the SGD pull's arm: chosen on its own
    run("age-sgd-30", 30, 0.525, (0.60, 0.60), (0.51, 0.52), "age", "sgd")
    table = select_epsilon(tmp_path)
    chosen = table[table["chosen"]].set_index(["attribute", "embedding-step"])["epsilon"].to_dict()
    assert chosen == {("gender", "local"): 0.1, ("age", "local"): 0.3, ("age", "sgd"): 10.0}
    assert len(table[table["epsilon"] == 0]) == 3  # the original's one run, a reference row per attribute and arm
    age = table[(table["attribute"] == "age") & (table["embedding-step"] == "local")].set_index("epsilon")
    assert abs(age.loc[0.3, "val-HR@10-change-%"] - 100 * (0.52 / 0.54 - 1)) < 1e-9
    assert age.loc[0.0, "logreg-auc"] == 0.64


def _age_sgd_run(root, seed, eps, val_hr, age_aucs, test_hr=0.5):
    """One ``select-eps`` run of the SGD pull against age (``eps`` 0: the original model) on validation seed ``seed``."""
    folder = root / "runs" / "select-eps" / "FedNCF" / f"age-sgd-eps{eps}-seed{seed}"
    folder.mkdir(parents=True)
    config = {"seed": seed, "client": "fedrec" if eps == 0 else "fedau2", "adversary-epsilon": eps or 1.0}
    if eps:
        config.update({"protected-attribute": "age", "adversary-embedding-optimizer": "sgd"})
    (folder / "config.json").write_text(json.dumps({"run-config": config}))
    (folder / "summary.json").write_text(
        json.dumps({"final": {"HR@10": test_hr, "val-HR@10": val_hr, "val-NDCG@10": val_hr / 2}})
    )
    inference = {f"{a}/{c}": {"auc": v} for a in ("gender", "age") for c, v in zip(("logreg", "mlp"), age_aucs)}
    (folder / "attack.json").write_text(json.dumps({"attribute-inference": inference}))


def test_the_robust_rule_reads_both_validation_seeds_with_its_margins(tmp_path):
    """The robust rule (``report.robust_choice``): eps 10 is in the plain band on seed 3 alone (the single-seed rule's
    choice), but the mean over seeds 3 and 4 leaves it outside the 0.04 band; eps 15 is inside on the mean with a
    -3.8% HR@10 change; eps 20 is inside but costs -4.8% (outside the -4% margin, inside the 5% target); eps 25 ran
    on seed 3 only (not eligible, whatever its numbers); test HR@10 plays no part."""
    from experiments.fedau2.report import robust_choice, select_epsilon, write_robust_choice

    _age_sgd_run(tmp_path, 3, 0, 0.50, (0.64, 0.60))
    _age_sgd_run(tmp_path, 4, 0, 0.50, (0.63, 0.61))
    _age_sgd_run(tmp_path, 3, 10, 0.49, (0.533, 0.549), test_hr=0.9)  # seed 3 alone: in the 0.05 band
    _age_sgd_run(tmp_path, 4, 10, 0.49, (0.565, 0.545), test_hr=0.9)  # mean LR 0.549: outside 0.04
    _age_sgd_run(tmp_path, 3, 15, 0.482, (0.525, 0.535), test_hr=0.1)  # mean LR 0.535, MLP 0.5385; -3.8%
    _age_sgd_run(tmp_path, 4, 15, 0.480, (0.545, 0.542), test_hr=0.1)
    _age_sgd_run(tmp_path, 3, 20, 0.477, (0.515, 0.520), test_hr=0.9)  # in the band, -4.8%: outside the margin
    _age_sgd_run(tmp_path, 4, 20, 0.475, (0.520, 0.525), test_hr=0.9)
    _age_sgd_run(tmp_path, 3, 25, 0.47, (0.500, 0.500), test_hr=0.9)  # seed 3 only: not eligible
    table = select_epsilon(tmp_path)
    single = table[table["chosen"] & (table["seed"] == 3)]["epsilon"].tolist()
    assert single == [10.0]  # what the single-seed rule would pick
    robust = robust_choice(table, (3, 4))
    assert robust["epsilon"].tolist() == [10.0, 15.0, 20.0]
    assert robust[robust["chosen"]]["epsilon"].tolist() == [15.0]
    row = robust.set_index("epsilon").loc[15.0]
    assert bool(row["meets-rule"])
    assert abs(row["val-HR@10-change-%"] - 100 * (0.481 / 0.50 - 1)) < 1e-9
    assert abs(row["mean-mlp-auc"] - 0.5385) < 1e-9 and abs(row["distance"] - 0.0385) < 1e-9
    assert not robust.set_index("epsilon").loc[20.0, "meets-rule"]  # -4.8%: the HR@10 margin binds
    assert not robust.set_index("epsilon").loc[10.0, "meets-rule"]  # the AUC margin on the mean binds
    written = write_robust_choice(tmp_path, table)
    assert written[written["chosen"]]["epsilon"].tolist() == [15.0]
    text = (tmp_path / "select-eps-robust.md").read_text()
    assert "0.9000" not in text and "0.1000" not in text  # no test HR@10 in the table


def test_the_robust_rule_falls_back_to_the_strongest_pull_within_the_hr_margin(tmp_path):
    """No eps meets both margins: the one within the HR@10 margin with the smallest AUC distance is chosen, flagged
    ``meets-rule`` False; an eps beyond the HR@10 margin is not chosen even if its AUCs are the closest to 0.5."""
    from experiments.fedau2.report import robust_choice, select_epsilon

    for seed in (3, 4):
        _age_sgd_run(tmp_path, seed, 0, 0.50, (0.64, 0.60))
        _age_sgd_run(tmp_path, seed, 10, 0.495, (0.56, 0.55))  # -1%, distance 0.06
        _age_sgd_run(tmp_path, seed, 20, 0.485, (0.55, 0.545))  # -3%, distance 0.05: chosen
        _age_sgd_run(tmp_path, seed, 30, 0.47, (0.51, 0.52))  # -6%: beyond the HR@10 margin
    robust = robust_choice(select_epsilon(tmp_path), (3, 4)).set_index("epsilon")
    assert robust.index[robust["chosen"]].tolist() == [20.0]
    assert not robust["meets-rule"].any()


def test_the_protocol_check_refuses_the_test_seeds():
    """``protocol-check`` is a diagnostic on the validation seeds: asking it for a test seed (0-2) is an error."""
    import argparse

    import pytest

    from experiments.fedau2.run import jobs_protocol_check

    with pytest.raises(SystemExit):
        jobs_protocol_check(argparse.Namespace(seeds=[4, 1], data_dir=""))
    names = [config.run_name for config, _ in jobs_protocol_check(argparse.Namespace(seeds=[3, 4], data_dir=""))]
    assert len(names) == 4 and all(n.endswith(("-seed3", "-seed4")) for n in names)
