"""Secure aggregation (SecAgg+) of a dict of float arrays over a set of nodes: the server learns only the sum.

Protocol: SecAgg+ (Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020), the
sparse-graph form of SecAgg (Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
CCS 2017), as Flower implements it. Every node ``i`` of the sampled set ``U`` has the float arrays ``x_i``
(``{key: ndarray}``, the same keys and shapes on every node) and the server obtains ``sum_{i in U3} x_i`` over the
nodes ``U3`` that were still there when the masked vectors were collected, without seeing any ``x_i``. Four stages,
each one round trip of the server with the surviving nodes:

1. **setup** (:func:`setup`): the node stores the protocol parameters and draws two key pairs, ``(sk1, pk1)`` for
   the pairwise masks and ``(sk2, pk2)`` for encrypting shares; it replies with the two public keys.
2. **share keys** (:func:`share_keys`): the node receives its neighbours' public keys, draws the self-mask seed
   ``b_i``, splits ``b_i`` and ``sk1`` into Shamir shares (any ``threshold`` of them reconstruct the secret) and
   replies with one share pair per neighbour, encrypted under the ECDH key ``KDF(sk2_i, pk2_j)``.
3. **collect masked vectors** (:func:`collect_masked_vectors`): the node decrypts the share pairs its neighbours
   sent (forwarded by the server), quantizes its arrays to integers ``q_i`` and replies with
   ``y_i = q_i + PRG(b_i) + sum_{j < i} PRG(s_ij) - sum_{j > i} PRG(s_ij)  (mod M)`` over the neighbours ``j`` whose
   shares it received, with ``s_ij = KDF(ECDH(sk1_i, pk1_j))`` (Bonawitz et al., Sec. 4, the masked input ``y_u``).
   The pairwise masks cancel in the sum of every pair that both reply.
4. **unmask** (:func:`unmask`): the node replies with its share of ``b_v`` for every neighbour ``v`` that sent a
   masked vector, and its share of ``sk1_d`` for every neighbour ``d`` that shared keys but sent none. The server
   reconstructs every survivor's ``b_v`` (and subtracts ``PRG(b_v)``) and every dropped node's ``sk1_d`` (and
   removes the pairwise masks ``d``'s survivors applied): what is left is ``sum q_i (mod M)``.

A node never gives both shares of one node (it refuses an unmask request whose active and dropped lists overlap),
answers one unmask per protocol run, and forgets its secrets once it has answered.

**Why not Flower's own stage handlers.** Flower 1.42 ships SecAgg+ as ``flwr.client.mod.secaggplus_mod`` and
``flwr.server.workflow.SecAggPlusWorkflow``. They do not compose with a Message-API strategy sending custom query
messages: the mod acts only on ``MessageType.TRAIN`` messages and takes the vector from the wrapped ClientApp's
legacy ``FitRes`` (``num_examples``-weighted, with a weight factor prepended), its stage functions (``_setup``,
``_share_keys``, ...) are private and take legacy ``Parameters``; the workflow's stage methods need a
``LegacyContext`` (its ``configure_fit`` / ``aggregate_fit`` strategy and client manager), build their own TRAIN
messages and hand the result to ``aggregate_fit`` instead of returning it. Flower also draws the stochastic
rounding from numpy's global random state. So the four stages are rebuilt here as pure functions of a state mapping
and a config, on Flower's primitives, with no cryptography of our own:

* key pairs (ECDH on SECP384R1) and their serialisation: ``flwr.supercore.primitives.asymmetric``
  (``generate_key_pairs``, ``private_key_to_bytes``, ``bytes_to_private_key``, ``public_key_to_bytes``,
  ``bytes_to_public_key``);
* shared keys and authenticated encryption of the shares: ``flwr.common.secure_aggregation.crypto.
  symmetric_encryption`` (``generate_shared_key``: ECDH + HKDF-SHA256; ``encrypt`` / ``decrypt``: Fernet);
* Shamir shares: ``flwr.common.secure_aggregation.crypto.shamir`` (``create_shares``, ``combine_shares``);
* the share plaintext layout (source, destination, both shares): ``secaggplus_utils.share_keys_plaintext_concat`` /
  ``share_keys_plaintext_separate``; the masks: ``secaggplus_utils.pseudo_rand_gen``; the modular arithmetic:
  ``ndarrays_arithmetic`` (``parameters_addition``, ``parameters_subtraction``, ``parameters_mod``).

Two departures from Flower, both for cost and correctness, not for new cryptography: the secret shared for ``sk1``
is the private scalar (48 bytes, rebuilt with ``cryptography``'s ``ec.derive_private_key``) rather than its 306-byte
PEM, which makes Shamir sharing and reconstruction about 3 times cheaper; and the server removes a dropped node's
pairwise masks only for the survivors that actually applied them (the neighbours it forwarded the node's shares to).

**Quantization and its error.** Each element is clipped to ``[-c, c]`` (``c = clipping_range``) and stochastically
rounded to the grid ``-c + k * step``, ``k = 0 .. Q - 1`` (``Q = quantization_range``), ``step = 2c / (Q - 1)``:
``x -> -c + step * (floor(t) + [u < t - floor(t)])`` with ``t = (x + c) / step`` and ``u ~ U[0, 1)`` from the node's
generator. The rounding is unbiased and its error is below one ``step`` per element and per contributor, so every
element of the returned sum is within ``n * step`` of the sum of the clipped inputs (``n`` contributors; standard
deviation at most ``step * sqrt(n) / 2``), up to float64 rounding. The integer sum must not wrap around:
``n * (Q - 1) < M`` (``M = modulus_range``), which :func:`secure_sum` checks before it starts. With ``Q - 1`` a
multiple of ``2c`` (e.g. ``c = 1``, ``Q = 2**22 + 1``: ``step = 2**-21``) every integer in ``[-c, c]`` is a grid
point and ``step`` a power of two, so integer inputs such as per-item counts are summed exactly.

**Clipping.** Values outside ``[-c, c]`` are clipped, so the sum is then the sum of the clipped values. Choose ``c``
from a bound on the inputs' scale: a per-item count vector is bounded by the largest count a node can hold (an
integer count ``<= c`` is summed within ``n * step``); the gradient of a cross-entropy with respect to a linear
``h_w``'s weights is ``(softmax - onehot) outer e_u``, so each weight entry is at most ``max_j |e_u,j|`` and each
bias entry at most 1 (DSVAE noise adds its own ``N(0, sigma^2)`` tail; clip at a few ``sigma`` above that). Every
node also puts the number of its elements it clipped into the masked vector, so the server learns the total number
of clipped elements over the contributors (:attr:`SecureSum.clipped`) and nothing about which node clipped; a
nonzero total says ``c`` was too small. Non-finite inputs raise on the node.

**Randomness and determinism.** The key pairs and the self-mask seeds are fresh OS randomness on every run (Flower's
``generate_key_pairs`` and ``os.urandom``, as in Flower): they are the protocol's secrets and must not be derived
from a public seed, so the masked vectors differ between runs. The result does not depend on them (the masks cancel
exactly modulo ``M``): given each node's rounding generator (``rng`` of :func:`collect_masked_vectors`) and the
driver's ``seed`` (the neighbour graph), the returned sum is bit-for-bit reproducible.

**Limitations.** Security is against an honest-but-curious server and nodes that follow the protocol (no
authentication of public keys beyond the transport's, no consistency check of the dropped set: the "semi-honest"
setting of Bonawitz et al., Sec. 6). The sum of the survivors is revealed by design; a threshold ``t`` prevents the
server from reconstructing both secrets of a node only if it cannot make ``t`` neighbours answer inconsistently.
Flower's ``pseudo_rand_gen`` folds each seed to 32 bits and expands it with numpy's MT19937 (values in
``[0, M - 2]``), so one pairwise mask has 32 bits of entropy: unmasking one survivor's vector requires guessing the
pairwise seeds of all its surviving neighbours jointly (``2^(32 * neighbours)`` work), which is weak for a node with
a single neighbour.

Layout: the node-side stages and the quantization are in :mod:`fedrec_flwr.privacy.secagg_node` (re-exported
here); the server driver :func:`secure_sum` is here.

State (:func:`setup` ... :func:`unmask`): a mutable mapping of ConfigRecord values (``int``, ``float``, ``str``,
``bytes`` and lists of them), e.g. a node's ``context.state.config_records["secagg"]``; it holds the node's secrets
between stages. Configs and replies are dicts of the same value types, except the masked vector, a dict of uint32
arrays (an ``ArrayRecord`` on the wire: 4 bytes per element, as a float32 upload).
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    pseudo_rand_gen,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_public_key,
    public_key_to_bytes,
)

from fedrec_flwr.privacy.secagg_node import (
    CLIPPED_KEY,
    COLLECT_MASKED_VECTORS,
    COUNT_KEY,
    HANDLERS,
    RESERVED_PREFIX,
    SETUP,
    SHARE_KEYS,
    STAGES,
    UNMASK,
    SecAggError,
    Send,
    _scalar_to_private_key,
    collect_masked_vectors,
    dequantize,
    quantization_step,
    quantize,
    setup,
    share_keys,
    unmask,
)

__all__ = [
    "CLIPPED_KEY",
    "COLLECT_MASKED_VECTORS",
    "COUNT_KEY",
    "HANDLERS",
    "RESERVED_PREFIX",
    "SETUP",
    "SHARE_KEYS",
    "STAGES",
    "SecAggError",
    "SecureSum",
    "Send",
    "UNMASK",
    "collect_masked_vectors",
    "dequantize",
    "neighbourhoods",
    "quantization_step",
    "quantize",
    "secure_sum",
    "setup",
    "share_keys",
    "unmask",
]

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------------
# server side: the driver


@dataclass(frozen=True)
class SecureSum:
    """What :func:`secure_sum` returns: the sum over the contributors and what the server may know about it.

    Attributes:
        arrays: ``{key: float64 array}``, the sum of the contributors' clipped inputs, each element within
            ``error_bound`` of the exact sum.
        contributors: the node ids whose arrays are in the sum (sorted).
        clipped: the total number of elements the contributors clipped (0: the sum is of the unclipped inputs).
        error_bound: ``len(contributors) * step``, the bound on every element's quantization error.
    """

    arrays: dict[str, np.ndarray]
    contributors: tuple[int, ...]
    clipped: int
    error_bound: float

    @property
    def num_contributors(self) -> int:
        """How many nodes contributed."""
        return len(self.contributors)


def neighbourhoods(node_ids: Sequence[int], num_shares: int, rng: random.Random) -> dict[int, set[int]]:
    """SecAgg+'s communication graph, as Flower's ``SecAggPlusWorkflow`` builds it: the nodes shuffled on a ring,
    each node's neighbourhood the ``num_shares`` nodes (itself included) centred on it; every node when
    ``num_shares >= len(node_ids)`` (plain SecAgg)."""
    order = list(node_ids)
    if num_shares >= len(order):
        return {nid: set(order) for nid in order}
    rng.shuffle(order)
    half = num_shares // 2
    return {nid: {order[(i + offset) % len(order)] for offset in range(-half, half + 1)} for i, nid in enumerate(order)}


def _check_enough(stage: str, alive: set[int], graph: dict[int, set[int]], total: int, threshold: int) -> None:
    short = [nid for nid in alive if len(graph[nid] & alive) < threshold]
    if len(alive) < threshold or short:
        where = f"; {len(short)} of them have fewer than {threshold} live neighbours" if short else ""
        raise SecAggError(
            f"secure_sum: {len(alive)} of {total} nodes left after stage {stage!r}, the threshold is {threshold}{where}"
        )


def _valid_masked(reply: Mapping[str, Any], spec: Mapping[str, tuple[int, ...]], modulus: int) -> bool:
    expected = {**spec, COUNT_KEY: (1,), CLIPPED_KEY: (1,)}
    if set(reply) != set(expected):
        return False
    for key, shape in expected.items():
        value = np.asarray(reply[key])
        if value.shape != shape or value.dtype.kind not in "iu" or value.min(initial=0) < 0:
            return False
        if value.size and value.max() >= modulus:
            return False
    return True


def _check_parameters(
    nodes: list[int],
    spec: Mapping[str, tuple[int, ...]],
    threshold: int,
    k: int,
    clipping_range: float,
    quantization_range: int,
    modulus_range: int,
) -> None:
    """:func:`secure_sum`'s argument checks (``k``: the neighbourhood size)."""
    if len(set(nodes)) != len(nodes):
        raise ValueError("secure_sum: node_ids repeat a node")
    if any(key.startswith(RESERVED_PREFIX) for key in spec):
        raise ValueError(f"secure_sum: array keys must not start with {RESERVED_PREFIX!r}")
    if not 2 <= threshold <= k:
        raise ValueError(f"secure_sum: threshold {threshold} must be in [2, {k}] (the neighbourhood size)")
    if k < len(nodes) and k % 2 == 0:
        raise ValueError(f"secure_sum: num_shares {k} must be odd (the neighbourhood is centred on the node)")
    if (
        modulus_range > 2**32
        or modulus_range & (modulus_range - 1)
        or len(nodes) * (quantization_range - 1) >= modulus_range
    ):
        raise ValueError(
            f"secure_sum: modulus_range {modulus_range} must be a power of two <= 2**32 and exceed "
            f"{len(nodes)} * (quantization_range - 1) = {len(nodes) * (quantization_range - 1)}"
        )
    if not clipping_range > 0 or quantization_range < 2:
        raise ValueError("secure_sum: clipping_range must be > 0 and quantization_range >= 2")
    if len(nodes) < threshold:
        raise SecAggError(f"secure_sum: {len(nodes)} nodes sampled, the threshold is {threshold}")


def _remove_masks(
    masked: list[np.ndarray],
    shares: dict[int, list[bytes]],
    u3: set[int],
    forward: dict[int, dict[int, bytes]],
    public: dict[int, tuple[bytes, bytes]],
    threshold: int,
    modulus_range: int,
    shapes: list[tuple[int, ...]],
) -> list[np.ndarray]:
    """Stage 4's arithmetic: from the sum of the survivors' (``u3``) masked vectors, subtract every survivor's self
    mask ``PRG(b_v)`` and remove the pairwise masks the survivors applied with every dropped node ``d`` (the owners
    of ``shares`` not in ``u3``), from ``b_v`` and ``sk1_d`` rebuilt from ``shares[owner]``. ``forward[v]``: the
    nodes whose shares ``v`` received (its pairwise-mask partners); ``public[v]``: ``(pk1, pk2)``.

    Raises:
        SecAggError: fewer than ``threshold`` shares of a secret, shares that do not combine, or a rebuilt ``sk1``
            that does not match its ``pk1``.
    """
    for owner in sorted(shares):
        if len(shares[owner]) < threshold:
            raise SecAggError(
                f"secure_sum: {len(shares[owner])} shares of node {owner}'s secret came back, the threshold is {threshold}"
            )
        try:
            secret = combine_shares(shares[owner][:threshold])
        except ValueError as err:  # Flower's "Failed to combine shares": a share was altered
            raise SecAggError(f"secure_sum: the shares of node {owner}'s secret do not combine") from err
        if owner in u3:
            mask = pseudo_rand_gen(secret, modulus_range, shapes)
            masked = parameters_subtraction(masked, mask)
            continue
        sk1 = _scalar_to_private_key(secret)
        if public_key_to_bytes(sk1.public_key()) != public[owner][0]:
            raise SecAggError(
                f"secure_sum: the reconstructed key of dropped node {owner} does not match its public key"
            )
        for survivor in sorted(nid for nid in u3 if owner in forward[nid]):
            mask = pseudo_rand_gen(
                generate_shared_key(sk1, bytes_to_public_key(public[survivor][0])), modulus_range, shapes
            )
            # the survivor added the mask if survivor > owner, else subtracted it
            masked = parameters_subtraction(masked, mask) if survivor > owner else parameters_addition(masked, mask)
        masked = parameters_mod(masked, modulus_range)
    return masked


def secure_sum(
    send: Send,
    node_ids: Sequence[int],
    arrays_spec: Mapping[str, tuple[int, ...]],
    *,
    threshold: int,
    clipping_range: float,
    quantization_range: int = 2**22,
    modulus_range: int = 2**32,
    num_shares: int | None = None,
    seed: int | None = None,
) -> SecureSum:
    """Run the four SecAgg+ stages with ``node_ids`` through ``send`` and return the sum of the survivors' arrays.

    Args:
        send: ``send(stage, {node_id: config}) -> {node_id: reply}``, one round trip of the stage's handler on each
            node (wired to ``grid.send_and_receive`` with query messages); nodes absent from the reply have dropped.
        node_ids: the sampled nodes (distinct).
        arrays_spec: ``{key: shape}`` of the arrays every node sums (keys must not start with ``"secagg."``).
        threshold: the Shamir threshold ``t``: every secret needs ``t`` shares, and every stage needs at least ``t``
            live nodes (and, with ``num_shares``, ``t`` live nodes in every live node's neighbourhood); ``t >= 2``.
            More than half the neighbourhood (Bonawitz et al., Sec. 6) keeps a server that shows nodes inconsistent
            dropped sets from collecting ``t`` shares of both secrets of one node; less tolerates more drops.
        clipping_range: ``c``: inputs are clipped to ``[-c, c]`` (module docstring, "Clipping").
        quantization_range: ``Q``, the number of grid points of the quantization.
        modulus_range: ``M``, a power of two, at most ``2**32``, with ``len(node_ids) * (Q - 1) < M``.
        num_shares: SecAgg+'s neighbourhood size (odd, itself included; ``threshold <= num_shares``); ``None`` or
            ``>= len(node_ids)``: every node is every node's neighbour (SecAgg).
        seed: the neighbour graph's shuffle (``None``: fresh randomness).

    Returns:
        :class:`SecureSum`: the float64 sum, the contributors, the total clipped-element count and the error bound.

    Raises:
        ValueError: inconsistent parameters.
        SecAggError: fewer than ``threshold`` nodes (or neighbours) left after a stage, too few shares to unmask,
            or a reconstructed key that does not match its public key.
    """
    nodes = [int(n) for n in node_ids]
    total = len(nodes)
    spec = {str(k): tuple(int(d) for d in shape) for k, shape in arrays_spec.items()}
    k = total if num_shares is None else min(int(num_shares), total)
    _check_parameters(nodes, spec, threshold, k, clipping_range, quantization_range, modulus_range)
    graph = neighbourhoods(nodes, k, random.Random(seed))
    protocol_id = uuid.uuid4().hex
    keys = sorted(spec)

    # 1. setup: the public keys
    common = {
        "protocol-id": protocol_id,
        "threshold": threshold,
        "clipping-range": float(clipping_range),
        "quantization-range": int(quantization_range),
        "modulus-range": int(modulus_range),
        "keys": keys,
    }
    replies = send(SETUP, {nid: {**common, "node-id": nid} for nid in nodes})
    public = {nid: (r["pk1"], r["pk2"]) for nid, r in replies.items() if nid in graph}
    u1 = set(public)
    _check_enough(SETUP, u1, graph, total, threshold)

    # 2. share keys: the encrypted shares, forwarded to their destinations in stage 3
    contents = {}
    for nid in sorted(u1):
        peers = sorted(graph[nid] & u1)
        contents[nid] = {
            "protocol-id": protocol_id,
            "nids": peers,
            "pk1s": [public[p][0] for p in peers],
            "pk2s": [public[p][1] for p in peers],
        }
    replies = send(SHARE_KEYS, contents)
    u2 = {nid for nid in replies if nid in u1}
    _check_enough(SHARE_KEYS, u2, graph, total, threshold)
    forward: dict[int, dict[int, bytes]] = {nid: {} for nid in u2}
    for src in sorted(u2):
        for dst, ctxt in zip(replies[src]["dsts"], replies[src]["ctxts"]):
            if dst in u2 and dst in graph[src]:
                forward[dst][src] = ctxt

    # 3. collect masked vectors
    contents = {
        nid: {
            "protocol-id": protocol_id,
            "srcs": sorted(forward[nid]),
            "ctxts": [forward[nid][s] for s in sorted(forward[nid])],
        }
        for nid in sorted(u2)
    }
    replies = send(COLLECT_MASKED_VECTORS, contents)
    u3 = set()
    for nid, reply in replies.items():
        if nid in u2 and _valid_masked(reply, spec, modulus_range):
            u3.add(nid)
        elif nid in u2:
            log.warning("secure_sum: node %s sent a malformed masked vector; treated as dropped", nid)
    _check_enough(COLLECT_MASKED_VECTORS, u3, graph, total, threshold)
    order = [*keys, COUNT_KEY, CLIPPED_KEY]
    shapes = [spec[key] for key in keys] + [(1,), (1,)]
    masked = [np.zeros(shape, dtype=np.int64) for shape in shapes]
    for nid in sorted(u3):
        masked = parameters_mod(
            parameters_addition(masked, [np.asarray(replies[nid][key]).astype(np.int64) for key in order]),
            modulus_range,
        )

    # 4. unmask: the survivors' self-mask seeds and the dropped nodes' sk1
    dropped = u2 - u3
    contents = {
        nid: {"protocol-id": protocol_id, "active": sorted(graph[nid] & u3), "dead": sorted(graph[nid] & dropped)}
        for nid in sorted(u3)
    }
    replies = send(UNMASK, contents)
    shares: dict[int, list[bytes]] = {nid: [] for nid in u2}
    for nid, reply in replies.items():
        if nid not in u3:
            continue
        for owner, share in zip(reply["nids"], reply["shares"]):
            if int(owner) in shares and int(owner) in graph[nid]:
                shares[int(owner)].append(share)
    _check_enough(UNMASK, {nid for nid in replies if nid in u3}, graph, total, threshold)
    masked = _remove_masks(masked, shares, u3, forward, public, threshold, modulus_range, shapes)
    total_q = dict(zip(order, parameters_mod(masked, modulus_range)))
    count = int(total_q[COUNT_KEY][0])
    if count != len(u3):
        raise SecAggError(f"secure_sum: unmasking gave a contributor count of {count}, expected {len(u3)}")
    result = {key: dequantize(total_q[key], count, clipping_range, quantization_range) for key in keys}
    return SecureSum(
        arrays=result,
        contributors=tuple(sorted(u3)),
        clipped=int(total_q[CLIPPED_KEY][0]),
        error_bound=count * quantization_step(clipping_range, quantization_range),
    )
