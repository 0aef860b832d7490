"""The protocol, forget sets and unlearning variants of the HF-KCU experiments, declared once.

Protocol (as in the FedRecGEL / FedAU² experiments): leave-one-out with 99 sampled negatives, 100 rounds, 10% of
users per round, one local epoch (Adam 0.01, batch 256, 4 negatives per positive), 100 users per node (the same model
as one user per node up to float summation order), every remaining user evaluated. Unlearning happens after round
100; retraining runs the same 100 rounds with the same seed, so every remaining user trains in exactly the same
rounds as in the original run.
"""

from __future__ import annotations

ROUNDS = 100

PROTOCOL = {
    "num-server-rounds": ROUNDS,
    "local-epochs": 1,
    "fraction-train": 0.1,
    "fraction-evaluate": 1.0,
    "eval-every": ROUNDS,
    "num-test-negatives": 99,
    "ks": "5,10,20",
    "embedding-dim": 32,
    "mlp-layers": "64,32,16",
    "optimizer": "adam",
    "learning-rate": 0.01,
    "batch-size": 256,
    "strategy": "item-fedavg",
    "users-per-node": 100,
}

DATASETS = ("ml-100k", "filmtrust")
MODELS = {"FedMF": {"model": "mf"}, "FedNCF": {"model": "ncf"}}

FORGET_SETS = {"one user": None, "1%": 0.01, "5%": 0.05}
"""Forget-set name -> fraction of users (``None``: exactly one user), drawn with :func:`fedrec_flwr.strategies.unlearning.
forget_set`'s seeded stream."""

VARIANTS = {
    "HF-KCU distributed CG": {"method": "hfkcu", "krylov_mode": "distributed"},
    "HF-KCU local CG (Alg. 1)": {"method": "hfkcu", "krylov_mode": "local"},
    "HF-KCU distributed, eta=1 (Newton)": {
        "method": "hfkcu",
        "krylov_mode": "distributed",
        "scale": 1.0,
        "adaptive_scale": False,
    },
    "gradient ascent": {"method": "gradient-ascent"},
    "continued training (5 rounds)": {"method": "continue"},
}
"""Unlearning phases applied to the trained model (:class:`fedrec_flwr.strategies.unlearning.UnlearningSettings` fields; the
rest are the run config's defaults: k = 10, damping 0.01, eta 0.01 with the adaptive cap, causal weighting)."""

ABLATIONS = {
    "distributed, no causal weighting": {"method": "hfkcu", "causal_weighting": False},
    "distributed, no adaptive scale": {"method": "hfkcu", "adaptive_scale": False},
    "distributed, damping 0.001": {"method": "hfkcu", "damping": 0.001},
    "distributed, damping 0.1": {"method": "hfkcu", "damping": 0.1},
    "distributed, k = 1": {"method": "hfkcu", "cg_iterations": 1},
    "distributed, k = 5": {"method": "hfkcu", "cg_iterations": 5},
    "distributed, k = 20": {"method": "hfkcu", "cg_iterations": 20},
    "Newton, damping 0.1": {"method": "hfkcu", "scale": 1.0, "adaptive_scale": False, "damping": 0.1},
    "Newton, damping 1": {"method": "hfkcu", "scale": 1.0, "adaptive_scale": False, "damping": 1.0},
    "local, no causal weighting": {"method": "hfkcu", "krylov_mode": "local", "causal_weighting": False},
}
"""Ablations (ML-100K, the 1% forget set; distributed CG unless named)."""

ABLATION_SETTING = ("ml-100k", "1%")
