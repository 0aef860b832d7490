"""Simulation-only analyses of the HF-KCU experiments: scores under a given model with given users' private state,
membership inference, the KL divergence between two models' candidate distributions, the parameter gap, and a target
item's exposure. They read private state the server never has (a deployment never exposes it).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord, Context, RecordDict
from scipy.special import log_softmax

from fedrec_flwr.app.client_app import make_client
from fedrec_flwr.attacks import membership_auc, nonmember_items
from fedrec_flwr.clients.fedrec import STATE_PREFIX
from fedrec_flwr.local.training import score_candidates


def private_records(grid, users) -> dict[int, ArrayRecord]:
    """User -> a copy of its private record in a :class:`~fedrec_flwr.serial.SerialGrid`'s node states."""
    out = {}
    for context in grid.contexts.values():
        for user in users:
            key = f"{STATE_PREFIX}{int(user)}"
            if key in context.state:
                out[int(user)] = ArrayRecord({k: v for k, v in context.state[key].items()})
    return out


def scores(
    runtime, records: Mapping[int, ArrayRecord], arrays: Mapping[str, np.ndarray], items: Mapping[int, np.ndarray]
) -> dict[int, np.ndarray]:
    """User -> logits of ``items[user]`` under shared ``arrays`` and the user's private ``records[user]`` (a user
    without a record, i.e. never trained, gets its initial embedding)."""
    shared = {k: np.asarray(v) for k, v in arrays.items()}
    out = {}
    for user, wanted in items.items():
        state = RecordDict({f"{STATE_PREFIX}{user}": records[user]} if user in records else {})
        client = make_client(
            runtime, int(user), Context(run_id=0, node_id=0, node_config={}, state=state, run_config={})
        )
        client.load_shared(shared)
        client.load_private()
        out[user] = score_candidates(runtime.model, np.array([0]), np.asarray(wanted)[None, :])[0]
    return out


def candidate_scores(runtime, records, arrays, users) -> np.ndarray:
    """``(len(users), 100)`` logits of each user's test candidates (held-out item first, then its 99 negatives)."""
    split = runtime.split
    items = {int(u): np.concatenate([[split.test_items[u]], split.test_negatives[u]]) for u in users}
    got = scores(runtime, records, arrays, items)
    return np.stack([got[int(u)] for u in users])


def mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over users (rows) of ``KL(softmax(p) || softmax(q))`` over the candidates (nats)."""
    log_p, log_q = log_softmax(p_logits, axis=1), log_softmax(q_logits, axis=1)
    return float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=1)))


def parameter_gap(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float:
    """``||theta - theta_ref|| / ||theta_ref||`` over all shared parameters."""
    diff = sum(
        float(np.sum((np.asarray(arrays[k], np.float64) - np.asarray(reference[k], np.float64)) ** 2))
        for k in reference
    )
    return float(np.sqrt(diff / sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in reference.values())))


def membership(runtime, records, arrays, users, seed: int) -> dict[str, float]:
    """Membership inference on ``users``: their training items against as many never-interacted items (seeded),
    scored with each user's private ``records`` and shared ``arrays`` (:func:`fedrec_flwr.attacks.membership_auc`)."""
    split = runtime.split
    rng = np.random.default_rng([seed, 0x4D49])
    members, others = {}, {}
    for user in users:
        positives = split.positives(int(user))
        members[int(user)] = positives
        others[int(user)] = nonmember_items(split, int(user), positives.size, rng)
    got_members = scores(runtime, records, arrays, members)
    got_others = scores(runtime, records, arrays, others)
    return membership_auc([got_members[int(u)] for u in users], [got_others[int(u)] for u in users])


def exposure(runtime, records, arrays, users, target: int, k: int = 10) -> dict[str, float]:
    """How visible ``target`` is to ``users`` (those who never interacted with it), ranked among all items each user
    never interacted with: ``exposure`` = share with ``target`` in their top ``k``; ``target-percentile`` = mean
    share of those items the target outscores (0.5 = a random item; a finer signal than the top-k share)."""
    split = runtime.split
    everything = np.arange(split.num_items)
    hits, percentiles = 0, []
    for user in users:
        if target in split.interacted(int(user)):
            continue
        got = scores(runtime, records, arrays, {int(user): everything})[int(user)]
        got[split.interacted(int(user))] = -np.inf
        candidates = np.isfinite(got)
        top = np.argpartition(-got, k)[:k]
        hits += int(target in top)
        percentiles.append(float(np.mean(got[candidates] < got[target])))
    return {
        "exposure": hits / max(len(percentiles), 1),
        "target-percentile": float(np.mean(percentiles)) if percentiles else float("nan"),
    }
