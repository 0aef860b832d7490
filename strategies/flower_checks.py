"""Checks of a Flower strategy run through :class:`~fedrec_flwr.strategies.flower_adapter.FlowerStrategyAdapter`
that refuse a run before round 1: rounds too small for a Byzantine-robust rule (:func:`robust_aggregation_shortfall`),
rounds whose size does not match a server-side DP wrapper's calibration (:func:`dp_sample_size_mismatch`), the whole
run's rounds (:func:`check_round_sizes`), and message-config keys the client does not honour
(:func:`check_sent_keys`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import Strategy

from fedrec_flwr.app.preflight import quiet
from fedrec_flwr.errors import ConfigError
from fedrec_flwr.state.client_state import DURABLE_ROUND_KEY, RUN_KEY
from fedrec_flwr.wire import CONFIG

from .flower_views import RoundNodes
from .sampling import forgotten_after_phase

__all__ = [
    "OUR_CONFIG_KEYS",
    "check_round_sizes",
    "check_sent_keys",
    "dp_sample_size_mismatch",
    "node_level_dp_warning",
    "refuse_unhonoured",
    "robust_aggregation_shortfall",
    "server_side_dp",
]

OUR_CONFIG_KEYS = frozenset({"server-round", "users", "split", RUN_KEY, DURABLE_ROUND_KEY})
"""Message-config keys our clients read (any other key a strategy adds must be honoured by the client)."""


def _chain(wrapped: Strategy) -> Iterable[Strategy]:
    """``wrapped`` and the strategies it wraps (a DP wrapper's ``strategy``, and so on)."""
    seen, strategy = set(), wrapped
    while strategy is not None and id(strategy) not in seen:
        seen.add(id(strategy))
        yield strategy
        strategy = getattr(strategy, "strategy", None)


def robust_aggregation_shortfall(wrapped: Strategy, replies: int) -> str | None:
    """What a Byzantine-robust Flower strategy in ``wrapped``'s chain needs that ``replies`` train replies (``n``)
    miss, as a phrase naming the condition and its numbers, or ``None`` when nothing is missing.

    * Krum and MultiKrum (Blanchard et al. 2017, Prop. 1): ``n > 2f + 2`` for ``f = num_malicious_nodes``. Flower
      1.42 does not check it: ``select_multikrum`` scores each reply by its ``max(1, n - f - 2)`` nearest neighbours,
      so a smaller round silently scores against fewer neighbours than the rule's guarantee assumes. MultiKrum also
      needs ``num_nodes_to_select <= n`` (it takes the ``num_nodes_to_select`` best; with more it averages every
      reply, plain FedAvg).
    * Bulyan (El Mhamdi et al. 2018): ``n >= 4f + 3``; below it Flower's ``Bulyan.aggregate_train`` skips the
      aggregation (logs a warning, returns no arrays: the round leaves the model as it was).
    """
    from flwr.serverapp.strategy import Bulyan, Krum, MultiKrum

    for strategy in _chain(wrapped):
        name, f = type(strategy).__name__, getattr(strategy, "num_malicious_nodes", 0)
        if isinstance(strategy, Bulyan) and replies < 4 * f + 3:
            return (
                f"{name} needs at least 4 * num_malicious_nodes + 3 = {4 * f + 3} train replies per round "
                f"(num_malicious_nodes = {f}; El Mhamdi et al. 2018; with fewer Flower skips the aggregation)"
            )
        if isinstance(strategy, MultiKrum):
            if replies <= 2 * f + 2:
                return (
                    f"{name} needs more than 2 * num_malicious_nodes + 2 = {2 * f + 2} train replies per round "
                    f"(num_malicious_nodes = {f}; Blanchard et al. 2017)"
                )
            if not isinstance(strategy, Krum) and strategy.num_nodes_to_select > replies:
                return (
                    f"{name} with num_nodes_to_select = {strategy.num_nodes_to_select} needs at least that many "
                    "train replies per round (with fewer it averages all of them, plain FedAvg)"
                )
    return None


def server_side_dp(wrapped: Strategy) -> Strategy | None:
    """The first of Flower's server-side DP wrappers (``DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping``) in
    ``wrapped``'s chain of wrapped strategies, or ``None``."""
    from flwr.serverapp.strategy import (
        DifferentialPrivacyServerSideAdaptiveClipping,
        DifferentialPrivacyServerSideFixedClipping,
    )

    for strategy in _chain(wrapped):
        if isinstance(
            strategy, (DifferentialPrivacyServerSideFixedClipping, DifferentialPrivacyServerSideAdaptiveClipping)
        ):
            return strategy
    return None


def dp_sample_size_mismatch(
    dp: Strategy,
    rounds: Mapping[int, tuple[int, int]],
    *,
    num_users: int,
    fraction_train: float,
    users_per_node: int,
    remedy: str | None = None,
) -> str | None:
    """Why the server-side DP wrapper ``dp`` would not get ``num_sampled_clients`` train replies in every round, as
    one message naming the keys, the values and what to change, or ``None`` when every round gets exactly that many.

    The wrapper calibrates its Gaussian noise to ``num_sampled_clients`` replies (``stdv = noise_multiplier *
    clipping_norm / num_sampled_clients``; McMahan et al. 2018, DP-FedAvg), and Flower 1.42 only logs a warning in
    each round where the number of replies differs, so a wrong value silently releases an aggregate whose noise does
    not match the claimed guarantee. A round's replies are the nodes serving its sampled users (one per node).

    Args:
        dp: a server-side DP wrapper (:func:`server_side_dp`).
        rounds: the run's numbers of train nodes per round: ``{nodes: (first round with that many, its users)}``.
        num_users, fraction_train, users_per_node: the run's, for the message.
        remedy: what to change when the rounds differ, in place of "make every round reach the same number of nodes"
            (the caller's, e.g. when the rounds after an unlearning phase train without the forgotten users).
    """
    expected = int(dp.num_sampled_clients)
    if set(rounds) <= {expected}:
        return None
    name = type(dp).__name__
    where = (
        f"run-config key 'strategy-args': {name}(num_sampled_clients={expected}) must be the number of train "
        f"replies per round (one per node serving a sampled user: fraction-train {fraction_train:g} of "
        f"{num_users} users, users-per-node {users_per_node})"
    )
    if len(rounds) == 1:
        nodes, (server_round, users) = next(iter(rounds.items()))
        return (
            f"{where}, but every round has {nodes} (round {server_round}: {users} users on {nodes} nodes); with "
            f"{expected} its noise "
            f"would be calibrated to the wrong number of replies (Flower only warns, each round): set "
            f"num_sampled_clients={nodes} in 'strategy-args'"
        )
    low, high = min(rounds), max(rounds)
    return (
        f"{where}, but the rounds have from {low} (round {rounds[low][0]}) to {high} (round {rounds[high][0]}) "
        "nodes, so no num_sampled_clients fits every round; "
        + (
            remedy
            or (
                "make every round reach the same number of nodes: users-per-node = 1 (one reply per sampled user) or "
                "fraction-train = 1 (every node every round)"
            )
        )
    )


def node_level_dp_warning(wrapped: Strategy, users_per_node: int) -> str | None:
    """The warning for a server-side DP wrapper (Flower's ``DifferentialPrivacyServerSide*Clipping``, found anywhere in
    the chain of wrapped strategies, :func:`server_side_dp`) when a node serves several users, else ``None``.

    Such a wrapper clips each *reply* and calibrates its noise to one reply's bounded contribution (McMahan et al.
    2018, DP-FedAvg). A reply here is a node's mean over its trained users, so with ``users-per-node`` > 1 the
    protected unit is a node's group of users, not one user: user-level DP needs ``users-per-node = 1``."""
    strategy = server_side_dp(wrapped)
    if strategy is not None and users_per_node > 1:
        return (
            f"{type(strategy).__name__} clips and noises each reply, and with users-per-node = {users_per_node} "
            f"a reply is the mean of up to {users_per_node} users' updates: its guarantee is per node (a group "
            "of users), not per user; use users-per-node = 1 for user-level differential privacy"
        )
    return None


def refuse_unhonoured(name: str, sent: Mapping[str, Any], honoured: Iterable[str]) -> None:
    """Refuse a message-config key the strategy ``name`` sends (``sent``) that neither our clients read
    (:data:`OUR_CONFIG_KEYS`) nor the client honours (``honoured``: its ``strategy_config_keys``), unless its value is
    zero / empty.

    Raises:
        ConfigError: naming the strategy, the key and its value.
    """
    honoured = frozenset(honoured)
    for key, value in sent.items():
        if key in OUR_CONFIG_KEYS or key in honoured or value in (0, 0.0, False, "", None):
            continue
        raise ConfigError(
            f"run-config key 'strategy' = {name!r} sends the config key {key!r} = {value!r}, which the client does "
            f"not honour (its strategy_config_keys: {sorted(honoured)}); without it the strategy is not what it "
            "claims (e.g. FedProx without a proximal term, client-side DP without clipping). Use a client that "
            "honours it, or a value of 0 (run-config key 'strategy-args')"
        )


def check_sent_keys(wrapped: Strategy, honoured: Iterable[str]) -> list[dict[str, Any]]:
    """Let ``wrapped`` configure a round-1 train and evaluate round for one node, without sending anything, and refuse
    a config key it would send that the client does not honour (:func:`refuse_unhonoured`), so e.g. FedProx with
    ``proximal_mu > 0`` fails before the run starts, not in round 1. ``wrapped`` must be a fresh instance (its state
    may change; :meth:`FlowerStrategyAdapter.check_config` builds one for this). Returns the config of each message
    it would send (for the client's own check of the values, ``check_strategy_config``).

    Raises:
        ConfigError: as :func:`refuse_unhonoured`.
    """
    from flwr.supercore.task_identity import TaskIdentity

    name = f"{type(wrapped).__module__}:{type(wrapped).__name__}"
    grid = RoundNodes(None, [0], name)
    sent: list[dict[str, Any]] = []
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 0, 0  # Message() needs one, even unsent
    try:
        with quiet():  # Flower's "Sampled 1 nodes" lines: nothing is sampled
            for configure in (wrapped.configure_train, wrapped.configure_evaluate):
                for message in configure(1, ArrayRecord(), ConfigRecord(), grid):
                    sent.append(dict(message.content[CONFIG]) if CONFIG in message.content else {})
                    refuse_unhonoured(name, sent[-1], honoured)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    return sent


def check_round_sizes(adapter, users_per_node: int) -> None:
    """Refuse a run of ``adapter`` (a :class:`~fedrec_flwr.strategies.flower_adapter.FlowerStrategyAdapter` that
    knows its topology) in which some round's train replies (one per node serving a sampled user: the sampling is
    fixed by ``(seed, round)``) would be too few for the wrapped strategy (:func:`robust_aggregation_shortfall`),
    or would not number a server-side DP wrapper's ``num_sampled_clients`` (:func:`dp_sample_size_mismatch`).

    Raises:
        ConfigError: naming the condition, the first such round and its numbers of users and nodes.
    """
    robust = robust_aggregation_shortfall(adapter.wrapped, 0) is not None
    dp = server_side_dp(adapter.wrapped)
    if not robust and dp is None:  # nothing that counts the replies
        return
    num_users = adapter._topology().num_users
    all_nodes = len(set(adapter._topology().user_to_node.tolist()))
    if robust and robust_aggregation_shortfall(adapter.wrapped, all_nodes):  # no fraction-train can help
        raise ConfigError(
            f"strategy {adapter.name}: {robust_aggregation_shortfall(adapter.wrapped, all_nodes)}, but the federation "
            f"has only {all_nodes} nodes ({num_users} users, users-per-node {users_per_node}); lower "
            "'users-per-node' (more nodes), or change the strategy's arguments in 'strategy-args'"
        )
    rounds: dict[int, tuple[int, int]] = {}  # nodes -> (the first round with that many, its users)
    for server_round in adapter.planned_train_rounds():  # after unlearn-round: without the forgotten users
        users = adapter.planned_train_users(server_round)
        nodes = len(adapter._topology().group(users))
        rounds.setdefault(nodes, (server_round, len(users)))
        problem = robust_aggregation_shortfall(adapter.wrapped, nodes) if robust else None
        if problem:
            raise ConfigError(
                f"strategy {adapter.name}: {problem}, but round {server_round} trains {len(users)} users on {nodes} "
                f"nodes (fraction-train {adapter.fraction_train:g} of {num_users} users, users-per-node "
                f"{users_per_node}{forgotten_note(adapter, server_round)}); raise 'fraction-train' (or lower "
                "'users-per-node'), or change the strategy's arguments in 'strategy-args'"
            )
    problem = (
        dp_sample_size_mismatch(
            dp,
            rounds,
            num_users=num_users,
            fraction_train=adapter.fraction_train,
            users_per_node=users_per_node,
            remedy=forgetting_remedy(adapter, rounds),
        )
        if dp is not None
        else None
    )
    if problem:
        raise ConfigError(problem)


def forgetting_remedy(adapter, rounds: Mapping[int, tuple[int, int]]) -> str | None:
    """What to change when only the rounds after the unlearning phase (trained without the forgotten users) have
    another number of train nodes than the rounds before it, which all have one; ``None`` otherwise."""
    u = adapter.unlearning
    late = sorted((first, nodes) for nodes, (first, _) in rounds.items() if forgotten_note(adapter, first))
    early = {nodes for nodes, (first, _) in rounds.items() if not forgotten_note(adapter, first)}
    if not late or len(early) != 1:
        return None
    first, nodes = late[0]
    which = f"round {first}" if first <= adapter.num_rounds else f"its continue round {first - adapter.num_rounds}"
    why = (
        f"the rounds after the unlearning phase of round {u.round} train without its {len(u.forget)} forgotten "
        f"users ({which}: {nodes} nodes)"
    )
    if u.method == "continue":
        return (
            f"{why}; unlearning = 'continue' always trains rounds without them (its own, after the last), so "
            "with a server-side DP wrapper use another unlearning method and unlearn-round = 0"
        )
    return f"{why}: set unlearn-round = 0 (the phase after the last round, so every round trains the same users)"


def forgotten_note(adapter, server_round: int) -> str:
    """``", without the N forgotten users after the unlearning phase of round U"`` for a round that
    :meth:`~fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg.planned_train_users` trains
    without the forget set, else ``""`` (for the messages above)."""
    u = adapter.unlearning
    if not forgotten_after_phase(u, server_round):
        return ""
    if server_round > adapter.num_rounds:  # one of unlearning = "continue"'s own rounds
        return (
            f", round {server_round - adapter.num_rounds} of the {u.continue_rounds} continue-rounds of the "
            f"unlearning phase after round {u.round}, without its {len(u.forget)} forgotten users"
        )
    return f", without the {len(u.forget)} forgotten users after the unlearning phase of round {u.round}"
