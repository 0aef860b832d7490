"""Explicit random streams derived from ``(seed, purpose, user, round)``: never global RNG state.

Every random choice of a run comes from a generator built here, so no random choice depends on scheduling, the number
of Ray workers, or how users are grouped into nodes (the model is then bit-identical for a given grouping; another
grouping changes the order of float32 sums in aggregation, so results agree only up to rounding).
"""

from __future__ import annotations

import numpy as np
import torch

# Purpose tags: one per independent stream. Never reuse a tag for another purpose.
TAG_USER_INIT = 11
TAG_SHUFFLE = 12
TAG_MODEL_INIT = 13
TAG_CLIENT_EXTRA = 14
TAG_SECURE_ROUNDING = 21  # SecAgg+'s stochastic rounding of a node's vector (fedrec_flwr.app.queries)


def numpy_rng(seed: int, tag: int, *keys: int) -> np.random.Generator:
    """A numpy generator for the stream ``(seed, tag, *keys)``."""
    return np.random.default_rng([int(seed), int(tag), *(int(k) for k in keys)])


def torch_generator(seed: int, tag: int, *keys: int) -> torch.Generator:
    """A CPU torch generator for the stream ``(seed, tag, *keys)``, seeded through numpy's SeedSequence."""
    state = np.random.SeedSequence([int(seed), int(tag), *(int(k) for k in keys)]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 ^ int(state[1]))
