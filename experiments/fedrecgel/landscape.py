"""RQ4: the training-loss landscape around the converged shared parameters, for FedNCF and FedRecGEL.

Method: Li, Xu, Taylor, Studer, Goldstein (2018), "Visualizing the Loss Landscape of Neural Nets", NeurIPS, Sec. 4:
two random Gaussian directions ``d1, d2`` over the shared parameters, each *filter-normalised* (every row of a weight
matrix or embedding table rescaled to the norm of the same row of the parameters; bias directions set to zero), and
the loss ``L(theta* + a d1 + b d2)`` on a grid of ``(a, b)``. The loss is the mean BCE over a seeded sample of users'
training examples (their positives plus 4 sampled negatives each), each user scored with its own converged private
embedding.

This is a simulation-only analysis: it reads the users' private embeddings from the serial run's node states
(:func:`fedrec_flwr.serial.run_serial` with ``return_grid=True``); a deployment never exposes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from experiments.common import save_figure
from fedrec_flwr.app.runtime import get_runtime
from fedrec_flwr.data import sample_train_negatives
from fedrec_flwr.io import atomic_write_text
from fedrec_flwr.local.losses import batch_loss
from fedrec_flwr.models import build_model

VARIANTS: dict[str, tuple[str, dict]] = {
    "FedNCF": ("FedNCF", {}),
    "FedRecGEL w/o SAM": ("FedRecGEL", {"rho-shared": 0.0, "rho-private": 0.0}),
    "FedRecGEL": ("FedRecGEL", {}),
}
"""Landscape variants: name -> (method, overrides). "FedRecGEL w/o SAM" has FedRecGEL's server (gradient upload,
server Adam) without SAM, so that its comparison with FedRecGEL isolates SAM from the server optimizer."""
GRID = np.linspace(-1.0, 1.0, 21)
RADII = (0.05, 0.1, 0.2, 0.5, 1.0)
NUM_DIRECTIONS = 10
NUM_USERS = 300


def filter_normalised_direction(shared: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A random direction over the shared parameters, filter-normalised (Li et al. 2018, Sec. 4): for a tensor of
    2 or more dimensions each row ``d_r <- d_r / ||d_r|| * ||theta_r||``; 1-D tensors (biases) get a zero direction."""
    out = {}
    for key, value in shared.items():
        if value.dim() < 2:
            out[key] = torch.zeros_like(value)
            continue
        d = torch.randn(value.shape, generator=generator, dtype=value.dtype)
        rows_d = d.reshape(d.shape[0], -1).norm(dim=1).clamp_min(1e-12)
        rows_t = value.reshape(value.shape[0], -1).norm(dim=1)
        out[key] = d * (rows_t / rows_d).reshape(-1, *([1] * (d.dim() - 1)))
    return out


class LossProbe:
    """Mean BCE of a fixed set of users' examples as a function of the shared parameters.

    Args:
        runtime: the run's runtime (config, split). shared: the converged shared state. private_rows: user ->
            its private state (``"<key>"`` -> ``(1, d)``). seed: fixes the negatives.
    """

    def __init__(
        self, runtime, shared: dict[str, np.ndarray], private_rows: dict[int, dict[str, np.ndarray]], seed: int
    ):
        cfg, split = runtime.config, runtime.split
        users = sorted(private_rows)
        self.model = build_model(
            cfg.model,
            len(users),
            split.num_items,
            embedding_dim=cfg.embedding_dim,
            mlp_layers=cfg.mlp_layer_sizes,
            seed=0,
        )
        self.shared = {k: torch.as_tensor(v) for k, v in shared.items()}
        self.model.load_shared_state(self.shared)
        private = {k: np.concatenate([private_rows[u][k] for u in users]) for k in private_rows[users[0]]}
        self.model.load_private_state(private)
        u_idx, items, labels = [], [], []
        for row, user in enumerate(users):
            pos = split.positives(user)
            neg = sample_train_negatives(split, user, 0, cfg.num_train_negatives, seed)
            u_idx += [row] * (len(pos) + len(neg))
            items += list(pos) + list(neg)
            labels += [1.0] * len(pos) + [0.0] * len(neg)
        self.users = torch.as_tensor(u_idx)
        self.items = torch.as_tensor(items)
        self.labels = torch.as_tensor(labels, dtype=torch.float32)

    @torch.no_grad()
    def loss(self, offset: dict[str, torch.Tensor] | None = None) -> float:
        """Mean BCE at ``theta* + offset``."""
        state = self.shared if offset is None else {k: v + offset[k] for k, v in self.shared.items()}
        self.model.load_shared_state(state)
        return float(batch_loss("bce", self.model(self.users, self.items), self.labels))


def run_landscape(dataset: str, seed: int, data_dir: str, results: Path) -> None:
    """Train each of :data:`VARIANTS` (serial runs; a variant whose ``landscape.json`` exists is not retrained),
    then write the landscape tables and PNGs to ``results``."""
    from experiments.common import slug
    from experiments.fedrecgel.run import RUNS, run_config
    from fedrec_flwr.serial import run_serial

    torch.set_num_threads(1)
    grids, radii_rows = {}, []
    for name, (method, extra) in VARIANTS.items():
        folder = RUNS / "landscape" / dataset / f"{slug(name)}-seed{seed}"
        cache = folder / "landscape.json"
        if cache.is_file():  # computed before: the training run is not repeated
            cached = json.loads(cache.read_text())
            grids[name], radii_rows = np.array(cached["surface"]), radii_rows + cached["radii"]
            continue
        (folder / "summary.json").unlink(missing_ok=True)  # the private states are needed: train again
        config = run_config(dataset, method, seed, data_dir, folder.parent, folder.name, **extra)
        print(f"landscape: training {name} on {dataset}", flush=True)
        folder, grid = run_serial(config, return_grid=True)
        runtime = get_runtime(config.to_dict())
        shared = dict(np.load(folder / "final_arrays.npz"))
        rng = np.random.default_rng([seed, 77])
        private_rows = {}
        for user in rng.permutation(runtime.split.num_users):
            state = grid.contexts[1000 + int(user) // config.users_per_node].state
            key = f"user:{int(user)}"
            if key in state:
                private_rows[int(user)] = {k: v.numpy() for k, v in state[key].items()}
            if len(private_rows) == NUM_USERS:
                break
        probe = LossProbe(runtime, shared, private_rows, seed)
        generator = torch.Generator().manual_seed(seed)
        d1 = filter_normalised_direction(probe.shared, generator)
        d2 = filter_normalised_direction(probe.shared, generator)
        surface = np.array([[probe.loss({k: a * d1[k] + b * d2[k] for k in d1}) for a in GRID] for b in GRID])
        base = probe.loss()
        rows = []
        for radius in RADII:
            increases = []
            for _ in range(NUM_DIRECTIONS):
                d = filter_normalised_direction(probe.shared, generator)
                increases.append(probe.loss({k: radius * v for k, v in d.items()}) - base)
            rows.append(
                {
                    "dataset": dataset,
                    "method": name,
                    "radius": radius,
                    "loss at theta*": round(base, 5),
                    "mean loss increase": round(float(np.mean(increases)), 5),
                    "std": round(float(np.std(increases, ddof=1)), 5),
                    "users": len(private_rows),
                }
            )
        atomic_write_text(cache, json.dumps({"surface": surface.tolist(), "radii": rows}))
        grids[name], radii_rows = surface, radii_rows + rows
    table = pd.DataFrame(radii_rows)
    atomic_write_text(results / f"landscape-{dataset}.csv", table.to_csv(index=False))
    from experiments.common import markdown

    atomic_write_text(
        results / f"landscape-{dataset}.md",
        f"# Loss increase along random filter-normalised directions ({dataset}, {NUM_DIRECTIONS} "
        f"directions per radius)\n\n" + markdown(table),
    )
    long = pd.DataFrame(
        [
            {"method": m, "alpha": a, "beta": b, "loss": grids[m][j, i]}
            for m in grids
            for j, b in enumerate(GRID)
            for i, a in enumerate(GRID)
        ]
    )
    atomic_write_text(results / f"landscape-{dataset}-grid.csv", long.to_csv(index=False, float_format="%.6f"))
    _plots(dataset, grids, results)


def _plots(dataset: str, grids: dict[str, np.ndarray], results: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Plot the loss increase over each model's own centre, on shared logarithmic levels: sharpness is comparable
    # across models whose losses at the centre differ.
    centre = len(GRID) // 2
    increases = {m: g - g[centre, centre] for m, g in grids.items()}
    levels = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
    fig, axes = plt.subplots(1, len(grids), figsize=(5.0 * len(grids), 4.4))
    for axis, (method, surface) in zip(np.atleast_1d(axes), increases.items()):
        contour = axis.contour(
            GRID,
            GRID,
            np.maximum(surface, 1e-6),
            levels=levels,
            cmap="viridis",
            norm=matplotlib.colors.LogNorm(levels[0], levels[-1]),
        )
        axis.clabel(contour, inline=True, fontsize=7, fmt="%g")
        axis.plot(0, 0, "r+", markersize=12)
        axis.set_title(f"{method}: loss increase")
        axis.set_xlabel("alpha (direction 1)")
        axis.set_ylabel("beta (direction 2)")
    fig.suptitle(
        f"{dataset}: training-loss increase around the converged shared parameters "
        "(filter-normalised directions; same levels in every panel)"
    )
    save_figure(fig, results / f"landscape-{dataset}-contour.png")
    cap = 1.0
    fig = plt.figure(figsize=(5.0 * len(grids), 4.4))
    a, b = np.meshgrid(GRID, GRID)
    for index, (method, surface) in enumerate(increases.items(), 1):
        axis = fig.add_subplot(1, len(grids), index, projection="3d")
        axis.plot_surface(a, b, np.minimum(surface, cap), cmap="viridis", linewidth=0, vmin=0, vmax=cap)
        axis.set_zlim(min(0.0, float(surface.min())), cap)
        axis.set_title(method)
        axis.set_xlabel("alpha")
        axis.set_ylabel("beta")
        axis.set_zlabel("loss increase")
    fig.suptitle(f"{dataset}: loss-increase surface (clipped at {cap:g})")
    save_figure(fig, results / f"landscape-{dataset}-surface.png")
