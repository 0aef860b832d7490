"""The ClientApp's query handlers: one function per custom message type of :mod:`fedrec_flwr.wire`, registered by
:data:`QUERY_HANDLERS`.

* ``identify``: which users a node serves, the split's facts, and on a resume the state of the users' files;
* client unlearning (:mod:`fedrec_flwr.strategies.unlearning`): ``unlearn_gradient``, ``unlearn_affected``,
  ``unlearn_hvp``, ``unlearn_local_cg``, ``unlearn_loss``, ``unlearn_diagonal``, ``unlearn_counts`` and
  ``unlearn_margin``; their replies carry row-sparse sums over the shared parameters
  (:func:`fedrec_flwr.wire.pack_sparse`) or node totals, never a private parameter or a per-user value;
* ``adversary_gradient`` (FedAU²'s extra server steps of ``h_w``): ``h_w``'s mean gradient over the node's users
  (with ``secure-aggregation``: kept on the node, the reply carries ``num-examples`` only);
* ``secagg`` (``secure-aggregation = "secagg+"``): one SecAgg+ stage over the node's kept ``h_w`` vector.

Query handlers are always per-user (no vectorized block), each a thin adapter: :mod:`fedrec_flwr.app.handler_common`
unpacks the message and packs the reply, the client algorithm or a pure function computes. A new query is a handler
``(message, context, run_config=None) -> Message`` here (or in its own module of :mod:`fedrec_flwr.app`) and one entry
``message type -> handler`` in :data:`QUERY_HANDLERS`, which :func:`fedrec_flwr.app.client_app.make_client_app`
registers with ``ClientApp.query``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from fedrec_flwr.adversary.secure import SCALE_KEY, SECURE_KEY, WEIGHT_KEY, store_vector, take_vector
from fedrec_flwr.app.handler_common import (
    class_name,
    make_client,
    metric_record,
    private_state,
    query_setup,
    record_number,
    shared_arrays,
    sparse_reply,
)
from fedrec_flwr.app.runtime import Runtime, get_runtime, node_users
from fedrec_flwr.arrays import encode_array
from fedrec_flwr.errors import ConfigError, FedRecError
from fedrec_flwr.privacy.secagg import COLLECT_MASKED_VECTORS
from fedrec_flwr.privacy.secagg_records import answer, from_content
from fedrec_flwr.seeding import TAG_SECURE_ROUNDING, numpy_rng
from fedrec_flwr.state.client_state import (
    NEW_RUN_KEY,
    RESUME_ROUND_KEY,
    STATE_DIR_KEY,
    ClientStateStore,
    state_folder,
)
from fedrec_flwr.unlearning.influence import can_batch, influence_gn_diagonal, influence_loss_sums
from fedrec_flwr.unlearning.margin import margin_sums, positive_counts
from fedrec_flwr.wire import (
    ADVERSARY_GRADIENT,
    ARRAYS,
    CONFIG,
    IDENTIFY,
    METRICS,
    NUM_EXAMPLES,
    SECURE_AGGREGATION,
    SUPPORT,
    UNLEARN_AFFECTED,
    UNLEARN_COUNTS,
    UNLEARN_DIAGONAL,
    UNLEARN_GRADIENT,
    UNLEARN_HVP,
    UNLEARN_LOCAL_CG,
    UNLEARN_LOSS,
    UNLEARN_MARGIN,
    VECTOR,
    SparseSum,
    unpack_sparse,
)


def split_fingerprint(split) -> str:
    """A short hash of the split's preprocessing facts: nodes that disagree on the data are caught at start."""
    facts = json.dumps(split.meta, sort_keys=True, default=str)
    return hashlib.sha256(facts.encode()).hexdigest()[:16]


SPLIT_FACTS = (
    "held_out_order",
    "tie_rule",
    "tie_rule_applied",
    "timestamps",
    "min_user_interactions",
    "interactions_in_file",
    "duplicates_removed",
    "dropped_users",
    "dropped_items",
    "interactions_of_dropped_users",
    "num_interactions",
    "users_with_tied_latest",
    "holdout_validation",
    "num_test_negatives",
    "seed",
    "source_sha256",
    "format_version",
)
"""What the split did (keys of :attr:`fedrec_flwr.data.Split.meta`), reported by ``identify`` and written to the
results folder's ``config.json`` by the ServerApp, which never reads the data itself."""


def split_facts(split) -> dict:
    """The :data:`SPLIT_FACTS` of ``split`` with kebab-case names (those its ``meta`` has)."""
    return {key.replace("_", "-"): split.meta[key] for key in SPLIT_FACTS if key in split.meta}


def identify(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Tell the server which block of users this node serves (derived from ``partition-id``, never ``node_id``).

    A node config that cannot serve the run (``partition-id`` out of range, missing keys) is answered with an error
    reply naming the problem rather than raised: the ServerApp stops the run with the first such reason, and Flower
    prints no traceback per node (``--num-supernodes 1000`` on 943 users would print ~4,200 lines of them). The same
    holds for a run config or data that cannot build the node's runtime (e.g. FedAU² on a dataset without the
    protected attribute under plain ``flwr run``, where no launcher preflight ran)."""
    try:
        runtime = get_runtime(run_config or context.run_config)
        served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    except FedRecError as err:
        return Message(error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(err)), reply_to=message)
    split = runtime.split
    record = ConfigRecord(
        {
            "partition-id": int(context.node_config["partition-id"]),
            "first-user": served.start,
            "num-users": len(served),
            "num-users-total": split.num_users,
            "num-items": split.num_items,
            "fingerprint": split_fingerprint(split),
            "num-attribute-classes": runtime.protected.num_classes if runtime.protected else 0,
            "split-facts": json.dumps(split_facts(split), sort_keys=True, default=str),
            # whether this node keeps its users' private state in files (a resumed run needs them)
            "client-state": bool(context.node_config.get(STATE_DIR_KEY, "") or runtime.config.client_state_dir),
        }
    )
    try:
        record.update(_resume_state_check(message, context, runtime, served))
    except FedRecError as err:
        return Message(error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(err)), reply_to=message)
    return Message(content=RecordDict({CONFIG: record}), reply_to=message)


def _resume_state_check(message: Message, context: Context, runtime: Runtime, served: range) -> dict:
    """On a resume (the identify query carries ``resume-round`` R), the ids of this node's users whose state files
    are damaged, and of those without a version of round <= R (:meth:`ClientStateStore.resume_problems`); the
    server, which knows from its checkpoint which users trained, decides what is lost. ``{}`` when not resuming,
    without state files, or when every served user has a readable version <= R."""
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    if config.get(NEW_RUN_KEY):  # a fresh run: state files of an earlier run of this name must not be mixed in
        folder = state_folder(context.node_config, runtime.config.client_state_dir, config)
        earlier = ClientStateStore(folder).earlier_users(served) if folder is not None else []
        return {"client-state-folder": str(folder), "client-state-earlier": earlier} if earlier else {}
    if RESUME_ROUND_KEY not in config:
        return {}
    folder = state_folder(context.node_config, runtime.config.client_state_dir, config)
    if folder is None:
        return {}
    damaged, absent = ClientStateStore(folder).resume_problems(
        served, int(config[RESUME_ROUND_KEY]), set_aside=bool(config.get("resume-resets-client-state", False))
    )
    facts = {"client-state-folder": str(folder)} if damaged or absent else {}
    if damaged:
        facts["client-state-damaged"] = damaged
    if absent:
        facts["client-state-absent"] = absent
    return facts


def unlearn_gradient(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Sum of the requested users' influence-loss gradients (:meth:`FedRecClient.influence_gradient`); the users are
    the ones being forgotten, and only their gradient, never their data, leaves the node."""
    runtime, users, config = query_setup(message, context, run_config)
    shared = shared_arrays(message)
    total, loss, client = SparseSum(runtime.layout), 0.0, None
    with private_state(context, runtime, config, users):
        for user in users:
            client = make_client(runtime, user, context)
            dense, rows, value = client.influence_gradient(shared)
            total.add(dense, rows)
            loss += float(record_number(value, "loss-sum (influence_gradient's loss)", client))
    return sparse_reply(message, total, {"loss-sum": loss}, client)


def _remaining_users(message: Message, context: Context, run_config):
    """The node's served users minus the message's ``exclude`` list (the forgotten users), and, with ``"causal" =
    true`` and a support, only those whose influence loss shares a row with it: ``(runtime, clients, config)``.
    The server never chooses individual users here, so every answer is a sum over the node's users."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    excluded = {int(u) for u in config.get("exclude", [])}
    clients = [make_client(runtime, u, context) for u in served if u not in excluded]
    if bool(config.get("causal", False)) and SUPPORT in message.content:
        support = message.content[SUPPORT]["rows"].numpy().astype(np.int64)
        clients = [c for c in clients if np.isin(c.influence_items(), support).any()]
    return runtime, clients, config


def unlearn_affected(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """How many of this node's remaining users share an influence-loss row with the sent support rows
    (``affected-users``), and the node's total number of such shared rows (``overlap``): node totals only."""
    _, clients, _ = _remaining_users(message, context, run_config)
    support = message.content[SUPPORT]["rows"].numpy().astype(np.int64)
    overlaps = [int(np.isin(c.influence_items(), support).sum()) for c in clients]
    record = ConfigRecord(
        {"affected-users": sum(1 for o in overlaps if o), "overlap": sum(overlaps), "remaining-users": len(clients)}
    )
    return Message(content=RecordDict({CONFIG: record}), reply_to=message)


def unlearn_hvp(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """Sum over the node's remaining (with ``causal``: affected) users of ``H_u v`` for the sent direction ``v`` (one
    distributed-CG product), in one batched pass where the model allows (:func:`fedrec_flwr.unlearning.influence.can_batch`)."""
    runtime, clients, config = _remaining_users(message, context, run_config)
    shared = shared_arrays(message)
    direction = unpack_sparse({k: a.numpy() for k, a in message.content[VECTOR].items()}, runtime.layout)
    total = SparseSum(runtime.layout)
    groups = [clients] if len(clients) > 1 and can_batch(runtime.model) else [[c] for c in clients]
    with private_state(context, runtime, config, [c.user for c in clients]):
        for group in groups:
            total.add(
                *group[0].influence_hvp(
                    shared, direction, group=group, curvature=str(config.get("curvature", "hessian"))
                )
            )
    total.count = len(clients)
    return sparse_reply(message, total, {}, clients[0] if clients else None)


def unlearn_loss(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """HF-KCU's line search on this node: ``loss-sums[k] = sum_u L_u(theta + a_k d)`` over the node's remaining (with
    ``causal``: affected) users, for the sent shared parameters ``theta``, direction ``d`` (``VECTOR``) and the
    config's ``steps`` ``a_k`` (:func:`fedrec_flwr.unlearning.influence.influence_loss_sums`). The reply carries only these
    node sums (and ``num-users``), no array and no per-user value."""
    runtime, clients, config = _remaining_users(message, context, run_config)
    shared = shared_arrays(message)
    direction = unpack_sparse({k: a.numpy() for k, a in message.content[VECTOR].items()}, runtime.layout)
    steps = [float(a) for a in config.get("steps", [])]
    with private_state(context, runtime, config, [c.user for c in clients]):
        sums = influence_loss_sums(runtime, clients, shared, direction, steps)
    metrics = metric_record(
        {"num-users": len(clients), "loss-sums": [float(v) for v in sums]}, clients[0] if clients else None
    )
    return Message(content=RecordDict({METRICS: metrics}), reply_to=message)


def unlearn_diagonal(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """HF-KCU's preconditioner on this node (``krylov-preconditioner``): the diagonal of ``sum_u G_u`` over the
    node's remaining (with ``causal``: affected) users, ``G_u`` the Gauss-Newton matrix
    (:func:`fedrec_flwr.unlearning.influence.influence_gn_diagonal`; config ``probes``, ``seed``). One row-sparse sum over the
    node's users, as an HVP reply; no per-user value."""
    runtime, clients, config = _remaining_users(message, context, run_config)
    shared = shared_arrays(message)
    total = SparseSum(runtime.layout)
    if clients:
        with private_state(context, runtime, config, [c.user for c in clients]):
            total.add(
                *influence_gn_diagonal(
                    runtime, clients, shared, probes=int(config.get("probes", 8)), seed=int(config.get("seed", 0))
                )
            )
    total.count = len(clients)
    return sparse_reply(message, total, {}, clients[0] if clients else None)


def unlearn_counts(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """HF-KCU's membership-margin step (:mod:`fedrec_flwr.unlearning.margin`): ``remaining`` = training positives per
    item over the node's remaining users (served minus ``exclude``), ``forgotten`` = the same over its users in
    ``exclude``. Two ``(I,)`` node totals; no model is needed and no per-user value is sent."""
    runtime = get_runtime(run_config or context.run_config)
    served = node_users(runtime.config, context.node_config, runtime.split.num_users)
    config = dict(message.content[CONFIG]) if CONFIG in message.content else {}
    excluded = {int(u) for u in config.get("exclude", [])}
    counts = {
        "remaining": positive_counts(runtime, [u for u in served if u not in excluded]),
        "forgotten": positive_counts(runtime, [u for u in served if u in excluded]),
    }
    return Message(
        content=RecordDict({ARRAYS: ArrayRecord({k: encode_array(v) for k, v in counts.items()})}), reply_to=message
    )


def unlearn_margin(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """HF-KCU's membership-margin step on this node: ``margin-sums[k]`` = the sum of the requested (forgotten)
    users' membership margins at ``theta + a_k d`` (config ``steps``, ``bins``, ``dominated``;
    :func:`fedrec_flwr.unlearning.margin.margin_sums`) and ``margin-count``, their number. Node sums only."""
    runtime, users, config = query_setup(message, context, run_config)
    shared = shared_arrays(message)
    direction = unpack_sparse({k: a.numpy() for k, a in message.content[VECTOR].items()}, runtime.layout)
    steps = [float(a) for a in config.get("steps", [])]
    with private_state(context, runtime, config, users):
        clients = [make_client(runtime, u, context) for u in users]
        sums, count = margin_sums(
            runtime,
            clients,
            shared,
            direction,
            steps,
            np.asarray(config.get("bins", []), dtype=np.int64),
            np.asarray(config.get("dominated", []), dtype=np.int64),
        )
    metrics = metric_record(
        {"num-users": len(users), "margin-sums": [float(v) for v in sums], "margin-count": count},
        clients[0] if clients else None,
    )
    return Message(content=RecordDict({METRICS: metrics}), reply_to=message)


def unlearn_local_cg(message: Message, context: Context, run_config: Mapping[str, Any] | None = None) -> Message:
    """HF-KCU's Algorithm 1 on this node: each remaining (with ``causal``: affected) user ``u`` solves ``(H_u +
    damping I) x_u = rhs`` by CG on its own Hessian; the reply is ``sum_u w_u x_u`` and ``weight-sum = sum_u w_u``
    with ``w_u = ||∇L_u||`` (with ``causal``; else 1), so the server can normalise over all nodes. A solve that meets
    non-positive curvature (plain CG) or ends with a relative residual above 1 (worse than no step) is left out and
    counted. Config: ``iterations``, ``damping``, ``tolerance``, and optionally ``curvature`` (default
    ``"hessian"``), ``solver`` (``"cg"``) and ``radius`` (each user's trust radius, for ``"steihaug"``)."""
    runtime, clients, config = _remaining_users(message, context, run_config)
    shared = shared_arrays(message)
    rhs = unpack_sparse({k: a.numpy() for k, a in message.content[VECTOR].items()}, runtime.layout)
    causal = bool(config.get("causal", False))
    total = SparseSum(runtime.layout)
    stats = {
        "weight-sum": 0.0,
        "solved": 0.0,
        "dropped": 0.0,
        "max-iterations": 0.0,
        "max-residual": 0.0,
        "not-converged": 0.0,
        "negative-curvature": 0.0,
        "boundary": 0.0,
    }
    with private_state(context, runtime, config, [c.user for c in clients]):
        for client in clients:
            weight = 1.0
            if causal:
                dense, rows, _ = client.influence_gradient(shared)
                weight = float(
                    np.sqrt(
                        sum(float(np.sum(v**2)) for v in dense.values())
                        + sum(float(np.sum(v**2)) for _, v in rows.values())
                    )
                )
            dense, rows, result = client.influence_solve(
                shared,
                rhs,
                iterations=int(config["iterations"]),
                damping=float(config["damping"]),
                tolerance=float(config["tolerance"]),
                curvature=str(config.get("curvature", "hessian")),
                solver=str(config.get("solver", "cg")),
                radius=float(config["radius"]) if "radius" in config else None,
            )
            stats["not-converged"] += float(not result.converged)
            stats["negative-curvature"] += float(result.negative_curvature)
            stats["boundary"] += float(result.boundary)
            # plain CG's truncated iterate on non-positive curvature, or a step worse than none, is left out; a
            # trust-region step is a descent step of the local model (also along negative curvature) and is kept
            if not result.boundary and (result.negative_curvature or result.residual > 1.0):
                stats["dropped"] += 1.0
                continue
            total.add(dense, rows, weight)
            stats["weight-sum"] += weight
            stats["solved"] += 1.0
            stats["max-iterations"] = max(stats["max-iterations"], float(result.iterations))
            stats["max-residual"] = max(stats["max-residual"], float(result.residual))
    total.count = len(clients)
    return sparse_reply(message, total, stats, clients[0] if clients else None)


def adversary_gradient_query(
    message: Message, context: Context, run_config: Mapping[str, Any] | None = None
) -> Message:
    """FedAU²'s extra server step of ``h_w`` (:meth:`fedrec_flwr.strategies.adversary.AdversaryServerStep.extra_steps`): the
    mean over the requested users of each one's ``h_w`` gradient (``client.adversary_query_gradient``: the train
    reply's gradient, DSVAE noise included, at the sent ``h_w`` and the user's current embedding, which stays
    unchanged), under ``h_w``'s keys only, with ``num-examples`` = the number of users. No embedding, label or
    count per class leaves the node.

    Raises:
        ConfigError: the message names no user, or the client class has no ``adversary_query_gradient``.
    """
    runtime, users, config = query_setup(message, context, run_config)
    if not users:
        raise ConfigError("adversary_gradient query: no users requested")
    shared = shared_arrays(message)
    total: dict[str, np.ndarray] = {}
    with private_state(context, runtime, config, users):
        client = make_client(runtime, users[0], context)
        batched = getattr(client, "adversary_query_mean_gradient", None)  # one batched computation (not "off")
        mean = batched(shared, config, users) if batched is not None else None
        for user in users if mean is None else ():
            client = make_client(runtime, user, context)
            if not hasattr(client, "adversary_query_gradient"):
                raise ConfigError(
                    f"client {class_name(client)} does not answer the adversary_gradient query "
                    "(use client = 'fedau2' or 'fedau2-gel')"
                )
            for key, grad in client.adversary_query_gradient(shared, config).items():
                total[key] = total.get(key, 0.0) + np.asarray(grad, dtype=np.float64)
    if mean is None:
        mean = {k: v / len(users) for k, v in total.items()}
    metrics = metric_record({NUM_EXAMPLES: float(len(users))}, client)
    if config.get(SECURE_KEY):  # secure-aggregation: the node keeps its vector for the SecAgg+ stages
        vector = {k: np.asarray(v, dtype=np.float64) * len(users) for k, v in mean.items()}
        vector[WEIGHT_KEY] = np.array([float(len(users))])
        store_vector(context.state, int(config["server-round"]), int(config["adversary-step"]), vector)
        return Message(content=RecordDict({METRICS: metrics}), reply_to=message)
    arrays = ArrayRecord({k: encode_array(np.asarray(v, dtype=np.float32)) for k, v in mean.items()})
    return Message(content=RecordDict({ARRAYS: arrays, METRICS: metrics}), reply_to=message)


def secure_aggregation_query(
    message: Message, context: Context, run_config: Mapping[str, Any] | None = None
) -> Message:
    """One SecAgg+ stage (:func:`fedrec_flwr.privacy.secagg_records.answer`) over the ``h_w`` vector this node kept
    for the config's ``server-round`` and ``adversary-step`` (:mod:`fedrec_flwr.adversary.secure`), divided by its
    ``vector-scale``; the stochastic rounding draws from a stream of (``seed``, round, step, ``partition-id``), so
    the sum is reproducible. The protocol's secrets stay in ``context.state`` and are forgotten after the unmask
    stage; the vector is forgotten once masked.

    Raises:
        SecAggError: a message that breaks the protocol, or no vector kept for that round and step (the server
            then counts this node as dropped).
    """
    runtime = get_runtime(run_config or context.run_config)
    stage, payload = from_content(message.content)
    arrays, rng = None, None
    if stage == COLLECT_MASKED_VECTORS:
        server_round, step = int(payload["server-round"]), int(payload["adversary-step"])
        arrays = take_vector(context.state, server_round, step, float(payload[SCALE_KEY]))
        partition = int(context.node_config.get("partition-id", 0))
        rng = numpy_rng(runtime.config.seed, TAG_SECURE_ROUNDING, server_round, step, partition)
    return Message(content=answer(message.content, context.state, arrays, rng=rng), reply_to=message)


QUERY_HANDLERS: dict = {
    IDENTIFY: identify,
    UNLEARN_GRADIENT: unlearn_gradient,
    UNLEARN_AFFECTED: unlearn_affected,
    UNLEARN_HVP: unlearn_hvp,
    UNLEARN_LOCAL_CG: unlearn_local_cg,
    UNLEARN_LOSS: unlearn_loss,
    UNLEARN_DIAGONAL: unlearn_diagonal,
    UNLEARN_COUNTS: unlearn_counts,
    UNLEARN_MARGIN: unlearn_margin,
    ADVERSARY_GRADIENT: adversary_gradient_query,
    SECURE_AGGREGATION: secure_aggregation_query,
}
"""Query action (a message of type ``"query.<action>"``; the names are :mod:`fedrec_flwr.wire`'s) -> its handler.
:func:`fedrec_flwr.app.client_app.make_client_app` registers every entry with ``ClientApp.query``, through the same
wrapper as train and evaluate (one torch thread; the run config an in-process simulation leaves out). A new query
adds its handler here."""
