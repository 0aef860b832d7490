"""The server's step of FedAU²'s attribute adversary ``h_w`` (``adversary-training = "server"``), for every strategy
derived from :class:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg`.

Ours (arXiv 2511.22872 does not say how the shared adversary is aggregated). With ``"per-client"`` training
each client fitted its copy of ``h_w`` to its single label with a fresh Adam state and the strategy averaged the copies:
a vote weighted by class counts, which learned the prior and collapsed. Here every client keeps the round's global
``h_w`` frozen (the SUT and the GRL read that copy) and uploads ``h_w``'s gradient at it
(:func:`fedrec_flwr.adversary.adversary_gradient`) under ``h_w``'s keys. The strategy averages those gradients with
the reply weights every other dense key uses (``num-examples``: FedAvg's example weights for parameter uploads, one
per user for gradient uploads) and takes one step of its own optimizer (``adversary-server-optimizer``, ``adversary-
server-learning-rate``): the federated gradient of the average cross-entropy over the round's users, i.e. centralised
mini-batch training of ``h_w`` over the sampled users. Its state persists over the run (and in checkpoints).

With ``adversary-server-steps = S > 1`` (ours: one step per round, 100 in a run, left ``h_w`` at the
majority class on ML-100K) the server then takes ``S - 1`` more steps in the same round (:meth:`AdversaryServerStep.
extra_steps`): each sends the current ``h_w`` to the round's sampled nodes in an ``adversary_gradient`` query
(:func:`fedrec_flwr.app.client_app.adversary_gradient_query`), each node answers with the mean ``h_w`` gradient over its
sampled users at their current (frozen) embeddings, the same function as the train reply's, DSVAE noise included, and
the server steps on the user-weighted mean (:meth:`AdversaryServerStep.apply`). The embeddings do not move between
these steps, so this is ``S`` optimizer steps of ``h_w`` on the round's users per round.

A reply's ``h_w`` gradient is one user's (with one user per node) or its node's weighted mean; no reply carries a
label or a class count. A single user's single-label gradient does name its label (iDLG); DSVAE's noise on the
uploaded contribution is what masks it (measured by :mod:`fedrec_flwr.strategies.curious`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from fedrec_flwr.adversary import ADVERSARY_MODULE, class_prior_text, parse_class_prior
from fedrec_flwr.adversary.adaptive import AdaptiveEpsilon, statistics_block
from fedrec_flwr.adversary.prior import MESSAGE_PRIOR_KEY, aggregate_shares, uses_aggregate_prior
from fedrec_flwr.adversary.secure import (
    EPSILON_KEY,
    SECURE_KEY,
    STATISTICS_KEY,
    SecureSettings,
)
from fedrec_flwr.errors import ConfigError, reply_error_line
from fedrec_flwr.local.training import load_optimizer_state_arrays, optimizer_state_arrays
from fedrec_flwr.wire import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, ModelLayout

from .adversary_rounds import (
    adaptive_from_config,
    adaptive_state_arrays,
    clear_statistics,
    restore_adaptive,
    secure_total,
    step_epsilon,
    step_on_total,
)

log = logging.getLogger(__name__)

PREFIX = ADVERSARY_MODULE + "."
CLASS_COUNTS_STATE = "prior/class-counts"
"""Checkpoint entry of the ``"aggregate"`` prior's per-class user counts."""


def adversary_keys(layout: ModelLayout) -> tuple[str, ...]:
    """The shared keys of ``h_w`` (``"adversary.<name>"``), in layout order."""
    return tuple(k for k in layout.dense_keys if k.startswith(PREFIX))


def mean_reply_gradient(accepted: list[RecordDict], keys) -> dict[str, np.ndarray]:
    """``sum_r n_r g_r / sum_r n_r`` over replies ``r`` (``n_r``: the ``num-examples`` metric, ``g_r``: the reply's
    array under each key), in float64: each reply's array is already its node's ``n``-weighted mean, so this is the
    weighted mean over users, however users are grouped into nodes (:mod:`fedrec_flwr.wire`)."""
    weights = np.array([float(r[METRICS][NUM_EXAMPLES]) for r in accepted], dtype=np.float64)
    out = {}
    for key in keys:
        stacked = np.stack([r[ARRAYS][key].numpy().astype(np.float64) for r in accepted])
        out[key] = np.tensordot(weights, stacked, axes=1) / weights.sum()
    return out


class AdversaryServerStep:
    """``h_w``'s server optimizer (module docstring).

    Args:
        keys: ``h_w``'s shared keys. optimizer: ``"adam"`` or ``"sgd"``. learning_rate: > 0.
        steps: server steps per round (``adversary-server-steps``, >= 1): the train replies' step and ``steps - 1``
            query steps (:meth:`extra_steps`).
        query_users: ``"sampled"`` (the round's users answer the queries) or ``"all"`` (``adversary-query-users``,
            ours: every user of the federation answers, so each extra step is a full-batch step of ``h_w`` over all
            users' current embeddings, the federated form of the experiments' oracle, an adversary refit on every user
            each round; without it ``h_w`` refits each round's ~94 users and its predicted class flips from round to
            round on ML-100K). Cost: every node answers ``steps - 1`` queries per round.

    Raises:
        ValueError: no keys, an unknown optimizer or query_users, a learning rate <= 0 or steps < 1.
    """

    def __init__(
        self,
        keys,
        *,
        optimizer: str = "adam",
        learning_rate: float = 0.01,
        steps: int = 1,
        query_users: str = "sampled",
        secure: SecureSettings | None = None,
        adaptive: AdaptiveEpsilon | None = None,
        aggregate_prior_classes: int = 0,
        seed: int = 0,
    ) -> None:
        self.keys = tuple(keys)
        if not self.keys:
            raise ValueError("AdversaryServerStep: the model has no adversary keys")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"AdversaryServerStep: optimizer must be 'adam' or 'sgd', got {optimizer!r}")
        if not learning_rate > 0:
            raise ValueError(f"AdversaryServerStep: learning_rate must be > 0, got {learning_rate!r}")
        if int(steps) != steps or steps < 1:
            raise ValueError(f"AdversaryServerStep: steps must be an integer >= 1, got {steps!r}")
        if query_users not in ("sampled", "all"):
            raise ValueError(f"AdversaryServerStep: query_users must be 'sampled' or 'all', got {query_users!r}")
        self.optimizer_name, self.learning_rate, self.steps = optimizer, float(learning_rate), int(steps)
        self.query_users = query_users
        self.secure, self.adaptive, self.seed = secure, adaptive, int(seed)
        # adversary-class-prior = "aggregate": the per-class user counts summed over every round so far
        self.class_counts = np.zeros(int(aggregate_prior_classes)) if aggregate_prior_classes else None
        self.parameters: dict[str, torch.nn.Parameter] = {}
        self.optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def from_config(cls, config, layout: ModelLayout) -> AdversaryServerStep | None:
        """The step for ``adversary-training = "server"`` with an adversary, else ``None``.

        Raises:
            ConfigError: ``adversary-class-prior`` does not fit the adversary's classes.
        """
        if config.adversary == "none" or config.adversary_training != "server":
            return None
        keys = adversary_keys(layout)
        try:
            parse_class_prior(class_prior_text(config), layout.shared_shapes[PREFIX + "head.bias"][0])
        except ValueError as err:
            raise ConfigError(str(err)) from None
        return cls(
            keys,
            optimizer=config.adversary_server_optimizer,
            learning_rate=config.adversary_server_learning_rate,
            steps=config.adversary_server_steps,
            query_users=config.adversary_query_users,
            secure=SecureSettings.from_config(config),
            adaptive=adaptive_from_config(config, int(layout.shared_shapes[PREFIX + "head.bias"][0])),
            aggregate_prior_classes=(
                int(layout.shared_shapes[PREFIX + "head.bias"][0]) if uses_aggregate_prior(config) else 0
            ),
            seed=config.seed,
        )

    def _ensure(self, current: Mapping[str, np.ndarray]) -> None:
        if self.optimizer is not None:
            return
        self.parameters = {
            k: torch.nn.Parameter(torch.tensor(np.asarray(current[k]), dtype=torch.float32)) for k in self.keys
        }
        make = torch.optim.Adam if self.optimizer_name == "adam" else torch.optim.SGD
        self.optimizer = make(list(self.parameters.values()), lr=self.learning_rate)

    def step(self, current: Mapping[str, np.ndarray], mean_gradient: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One optimizer step of ``h_w`` from ``current`` (the values sent this round) with ``mean_gradient``;
        returns the new values (float32)."""
        self._ensure(current)
        with torch.no_grad():  # start from what was sent (another phase, e.g. unlearning, may have changed it)
            for key, param in self.parameters.items():
                param.copy_(torch.as_tensor(np.asarray(current[key]), dtype=torch.float32))
        for key, param in self.parameters.items():
            param.grad = torch.as_tensor(np.asarray(mean_gradient[key]), dtype=torch.float32)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {k: p.detach().numpy().copy() for k, p in self.parameters.items()}

    def apply(self, current: ArrayRecord, accepted: list[RecordDict], arrays: ArrayRecord) -> ArrayRecord:
        """``arrays`` (the strategy's aggregate) with ``h_w``'s keys replaced by :meth:`step` on the accepted replies'
        mean gradient."""
        new = self.step({k: current[k].numpy() for k in self.keys}, mean_reply_gradient(accepted, self.keys))
        return ArrayRecord({k: Array(new[k]) if k in new else v for k, v in arrays.items()})

    @property
    def wants_statistics(self) -> bool:
        """Whether the train step's secure vector carries the nodes' summed adversary statistics (the adaptive rule
        reads them; the ``"aggregate"`` prior counts its classes from their ``users`` block)."""
        return self.adaptive is not None or self.class_counts is not None

    def train_config(self) -> dict[str, float | str]:
        """Keys the round's train messages carry: ``{"adaptive-epsilon": eps}`` under the adaptive rule and the
        ``"aggregate"`` prior's shares (:data:`~fedrec_flwr.adversary.prior.MESSAGE_PRIOR_KEY`, once any class count
        has arrived); ``{}`` without either."""
        out: dict[str, float | str] = {} if self.adaptive is None else {EPSILON_KEY: float(self.adaptive.epsilon)}
        return {**out, **self.prior_config()}

    def prior_config(self) -> dict[str, str]:
        """``{MESSAGE_PRIOR_KEY: shares}`` under the ``"aggregate"`` prior with counts, else ``{}``."""
        if self.class_counts is None or not self.class_counts.sum() > 0:
            return {}
        return {MESSAGE_PRIOR_KEY: aggregate_shares(self.class_counts)}

    def count_classes(self, statistics: np.ndarray | None) -> None:
        """Add the round's summed per-class user counts (the statistics' ``users`` block, quantization residue
        rounded away) to :attr:`class_counts` under the ``"aggregate"`` prior."""
        if self.class_counts is None or statistics is None:
            return
        users = statistics_block(np.asarray(statistics), "users", len(self.class_counts))
        self.class_counts = self.class_counts + np.maximum(np.rint(users), 0.0)

    def round_steps(
        self, strategy, server_round: int, arrays: ArrayRecord, accepted: list[RecordDict], accepted_nodes: list[int]
    ) -> ArrayRecord:
        """The round's steps of ``h_w`` after its train replies: the train step (:meth:`apply`, or with ``secure`` a
        SecAgg+ sum over the accepted nodes' kept vectors), the ``steps - 1`` query steps (:meth:`extra_steps`) and,
        under the adaptive rule, one step of ``eps`` on the round's summed statistics. Returns the new arrays.

        Args:
            strategy: the :class:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg` (its grid, the round's sent
                arrays ``_current`` and sampled nodes). arrays: the strategy's aggregate. accepted / accepted_nodes:
                the valid train replies and their nodes, in the same order.
        """
        current = strategy._current
        statistics = None
        if self.secure is None:
            arrays = self.apply(current, accepted, arrays)
            statistics = clear_statistics(accepted)
        else:  # the replies carry zeros under h_w's keys: start from what was sent
            arrays = ArrayRecord({k: current[k] if k in self.keys else v for k, v in arrays.items()})
            weights = {node: float(r[METRICS][NUM_EXAMPLES]) for node, r in zip(accepted_nodes, accepted)}
            total = secure_total(self, strategy, server_round, 0, weights, arrays)
            if total is not None:
                observe = getattr(strategy, "observe_secure_sum", None)  # a curious server attacks the sum (curious.py)
                if observe is not None:
                    observe(server_round, current, total)
                arrays = step_on_total(self, arrays, total)
                statistics = total.get(STATISTICS_KEY)
        if self.steps > 1:  # adversary-server-steps: S - 1 more, by adversary_gradient queries
            arrays = self.extra_steps(strategy, strategy._grid, server_round, arrays, strategy._sampled_nodes)
        if self.adaptive is not None:
            step_epsilon(self.adaptive, server_round, statistics)
        self.count_classes(statistics)
        return arrays

    def extra_steps(
        self, strategy, grid, server_round: int, arrays: ArrayRecord, nodes: Mapping[int, list[int]]
    ) -> ArrayRecord:
        """The round's ``steps - 1`` further steps (module docstring): each sends ``arrays`` (the current shared
        parameters) in an ``adversary_gradient`` query to every node of ``nodes`` (node -> the round's users there)
        and :meth:`apply` s the valid replies' mean gradient. A failed or invalid reply is left out with a warning;
        a step with no valid reply ends the round's extra steps. With ``query_users = "all"`` the queries go to every
        node of the strategy's topology, naming all its users, in place of ``nodes``. Returns the new arrays.

        Args:
            strategy: the :class:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg` (its ``message_config``,
                ``round_timeout`` and canonical reply order).
        """
        from fedrec_flwr.wire import ADVERSARY_GRADIENT

        if self.query_users == "all":
            topology = strategy._topology()
            nodes = topology.group(range(topology.num_users))
        for step in range(1, self.steps):
            messages = [
                Message(
                    content=RecordDict(
                        {
                            ARRAYS: arrays,
                            CONFIG: ConfigRecord(
                                {
                                    **strategy.message_config,
                                    "server-round": server_round,
                                    "users": list(users),
                                    "adversary-step": step,
                                    **self.prior_config(),
                                    **({SECURE_KEY: True} if self.secure is not None else {}),
                                }
                            ),
                        }
                    ),
                    message_type=f"{MessageType.QUERY}.{ADVERSARY_GRADIENT}",
                    dst_node_id=node,
                )
                for node, users in nodes.items()
                if len(users)
            ]
            replies = strategy._canonical_order(grid.send_and_receive(messages, timeout=strategy.round_timeout))
            if self.secure is not None:  # the nodes kept their vectors: one secure sum over those that did
                weights = {
                    int(r.metadata.src_node_id): float(r.content[METRICS][NUM_EXAMPLES])
                    for r in replies
                    if not r.has_error() and METRICS in r.content and r.content[METRICS].get(NUM_EXAMPLES, 0) > 0
                }
                total = secure_total(self, strategy, server_round, step, weights, arrays)
                if total is None:
                    log.warning("round %d: %d of %d server steps of h_w taken", server_round, step, self.steps)
                    break
                arrays = step_on_total(self, arrays, total)
                continue
            accepted, observed = [], []
            for reply in replies:
                problem = (
                    reply_error_line(reply.error.reason)
                    if reply.has_error()
                    else self._reply_problem(reply.content, arrays)
                )
                if problem:
                    log.warning(
                        "round %d, adversary step %d: node %d left out: %s",
                        server_round,
                        step + 1,
                        reply.metadata.src_node_id,
                        problem,
                    )
                else:
                    accepted.append(reply.content)
                    node = int(reply.metadata.src_node_id)
                    observed.append((node, reply.content[ARRAYS], len(nodes.get(node, ()))))
            observe = getattr(strategy, "observe_adversary_replies", None)  # a curious server links them (curious.py)
            if observe is not None and observed:
                observe(server_round, observed)
            if not accepted:
                log.warning(
                    "round %d: no valid adversary_gradient reply; %d of %d server steps of h_w taken",
                    server_round,
                    step,
                    self.steps,
                )
                break
            arrays = self.apply(arrays, accepted, arrays)
        return arrays

    def _reply_problem(self, content: RecordDict, current: ArrayRecord) -> str:
        """Why an ``adversary_gradient`` reply is unusable (``""`` if it is fine): exactly ``h_w``'s keys, shaped as
        sent, finite, and a positive ``num-examples``."""
        if ARRAYS not in content or METRICS not in content:
            return "no arrays or metrics"
        if set(content[ARRAYS].keys()) != set(self.keys):
            return f"keys {sorted(content[ARRAYS].keys())} are not h_w's {sorted(self.keys)}"
        for key in self.keys:
            value = content[ARRAYS][key].numpy()
            if value.shape != tuple(current[key].shape) or not np.all(np.isfinite(value)):
                return f"{key}: shape {value.shape} (sent {tuple(current[key].shape)}) or non-finite values"
        weight = content[METRICS].get(NUM_EXAMPLES)
        if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            return f"'{NUM_EXAMPLES}' must be a positive number, got {weight!r}"
        return ""

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The optimizer's state for a server checkpoint (empty before the first step), and under the adaptive rule
        the controller's (``adaptive/epsilon``, ``adaptive/steps``, ``adaptive/discounted``, ``adaptive/last-signal``)."""
        out = {} if self.optimizer is None else optimizer_state_arrays(self.optimizer)
        if self.class_counts is not None:
            out[CLASS_COUNTS_STATE] = self.class_counts.copy()
        return {**out, **adaptive_state_arrays(self.adaptive)}

    def load_state_arrays(self, current: ArrayRecord, arrays: Mapping[str, np.ndarray]) -> None:
        """Inverse of :meth:`state_arrays` (``current``: the checkpoint's shared parameters)."""
        self.adaptive, arrays = restore_adaptive(self.adaptive, arrays)
        arrays = dict(arrays)
        counts = arrays.pop(CLASS_COUNTS_STATE, None)
        if self.class_counts is not None and counts is not None:
            self.class_counts = np.asarray(counts, dtype=np.float64).copy()
        if not arrays:
            return
        self._ensure({k: current[k].numpy() for k in self.keys})
        load_optimizer_state_arrays(self.optimizer, dict(arrays))
