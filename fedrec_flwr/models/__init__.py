"""Recommendation models with an explicit private (user) / shared (item + score function) split.

Use :func:`build_model`; ``MODELS`` maps each name to its class.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedrec_flwr.errors import ConfigError
from fedrec_flwr.models.base import EMBEDDING_INIT_STD, RecModel
from fedrec_flwr.models.mf import MF
from fedrec_flwr.models.ncf import NCF
from fedrec_flwr.models.pfedrec import PFedRecModel

#: Model name -> class. Names are what run configs use (``model = "ncf"``).
MODELS: dict[str, type[RecModel]] = {"mf": MF, "ncf": NCF, "pfedrec": PFedRecModel}

__all__ = ["EMBEDDING_INIT_STD", "MF", "MODELS", "NCF", "PFedRecModel", "RecModel", "build_model"]


def build_model(
    name: str,
    num_users: int,
    num_items: int,
    *,
    embedding_dim: int = 32,
    mlp_layers: Sequence[int] = (64, 32, 16),
    mlp_embedding_dim: int = 0,
    seed: int = 0,
) -> RecModel:
    """Build a model on the CPU with a deterministic initialisation drawn from ``torch.Generator().manual_seed(seed)``.

    The same (name, sizes, seed) always gives bit-identical parameters; the global torch RNG is neither read nor
    advanced. A federated client builds the model with ``num_users=1`` (its own row, index 0) and then loads the
    server's shared state; the server builds it with any ``num_users`` (only the shared state is used).

    Args:
        name: ``"mf"``, ``"ncf"`` or ``"pfedrec"`` (case-insensitive).
        num_users, num_items: table sizes (positive).
        embedding_dim: width d of every embedding table.
        mlp_layers: NCF only: widths of the MLP tower (ignored by MF).
        mlp_embedding_dim: NCF only: width of the MLP embeddings; 0 = ``embedding_dim``.
        seed: initialisation seed (int).

    Raises:
        ConfigError: unknown ``name`` (the message lists the valid ones) or invalid sizes.
    """
    key = str(name).lower()
    if key not in MODELS:
        raise ConfigError(f"unknown model {name!r}; valid models: {sorted(MODELS)}")
    generator = torch.Generator().manual_seed(int(seed))
    try:
        if key == "ncf":
            return NCF(
                num_users,
                num_items,
                embedding_dim,
                mlp_layers,
                mlp_embedding_dim=mlp_embedding_dim,
                generator=generator,
            )
        return MODELS[key](num_users, num_items, embedding_dim, generator=generator)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
