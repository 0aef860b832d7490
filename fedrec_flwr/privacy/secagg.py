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

State (:func:`setup` ... :func:`unmask`): a mutable mapping of ConfigRecord values (``int``, ``float``, ``str``,
``bytes`` and lists of them), e.g. a node's ``context.state.config_records["secagg"]``; it holds the node's secrets
between stages. Configs and replies are dicts of the same value types, except the masked vector, a dict of uint32
arrays (an ``ArrayRecord`` on the wire: 4 bytes per element, as a float32 upload).
"""

from __future__ import annotations

import logging
import os
import random
import uuid
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    pseudo_rand_gen,
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from fedrec_flwr.errors import FedRecError

log = logging.getLogger(__name__)

SETUP = "setup"
SHARE_KEYS = "share-keys"
COLLECT_MASKED_VECTORS = "collect-masked-vectors"
UNMASK = "unmask"
STAGES = (SETUP, SHARE_KEYS, COLLECT_MASKED_VECTORS, UNMASK)

# Two slots every node adds to its masked vector (summed like the arrays): 1 per contributor, and the number of its
# elements it clipped. Array keys of the caller must not start with this prefix.
RESERVED_PREFIX = "secagg."
COUNT_KEY = "secagg.count"
CLIPPED_KEY = "secagg.clipped"

_CURVE = ec.SECP384R1()  # the curve of Flower's generate_key_pairs
_SCALAR_BYTES = 48
_SECRET_KEYS = ("sk1", "sk2", "seed", "peer-keys", "share-nids", "b-shares", "sk-shares")

# The send callable: stage name, {node_id: config (and arrays for no stage)} -> {node_id: reply}; a node absent
# from the reply dict has dropped.
Send = Callable[[str, dict[int, dict[str, Any]]], Mapping[int, Mapping[str, Any]]]


class SecAggError(FedRecError, RuntimeError):
    """Secure aggregation cannot go on: too few nodes left, or a message breaks the protocol."""


# ----------------------------------------------------------------------------------------------------------------
# quantization


def quantization_step(clipping_range: float, quantization_range: int) -> float:
    """The grid step ``2c / (Q - 1)`` of :func:`quantize`: the bound on its error per element and per contributor."""
    return 2.0 * float(clipping_range) / (int(quantization_range) - 1)


def quantize(
    x: np.ndarray, clipping_range: float, quantization_range: int, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """Clip ``x`` to ``[-c, c]`` and round it stochastically to integers in ``[0, Q - 1]`` (module docstring).

    Returns:
        the int64 array (``x``'s shape; ``-c + step * q`` is within one ``step`` of the clipped ``x``, unbiased) and
        the number of elements that were clipped.

    Raises:
        ValueError: ``x`` has a NaN or an infinite element.
    """
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("quantize: the array has a non-finite element")
    c = float(clipping_range)
    clipped = int(np.count_nonzero(np.abs(x) > c))
    t = (np.clip(x, -c, c) + c) / quantization_step(c, quantization_range)
    low = np.floor(t)
    q = low + (rng.random(t.shape) < t - low)
    return np.minimum(q, quantization_range - 1).astype(np.int64), clipped


def dequantize(total: np.ndarray, count: int, clipping_range: float, quantization_range: int) -> np.ndarray:
    """The float64 sum of ``count`` contributions from the sum ``total`` of their :func:`quantize` integers."""
    step = quantization_step(clipping_range, quantization_range)
    return np.asarray(total, dtype=np.float64) * step - count * float(clipping_range)


# ----------------------------------------------------------------------------------------------------------------
# client side: one pure handler per stage


def _expect(state: Mapping[str, Any], config: Mapping[str, Any], stage: str) -> None:
    previous = STAGES[STAGES.index(stage) - 1]
    if state.get("stage") != previous:
        raise SecAggError(f"secagg {stage}: the node is at stage {state.get('stage')!r}, expected {previous!r}")
    if config.get("protocol-id") != state.get("protocol-id"):
        raise SecAggError(f"secagg {stage}: protocol run {config.get('protocol-id')!r} is not the node's current one")


def _forget_secrets(state: MutableMapping[str, Any]) -> None:
    for key in _SECRET_KEYS:
        state.pop(key, None)


def _sk1_scalar(sk1_pem: bytes) -> bytes:
    return bytes_to_private_key(sk1_pem).private_numbers().private_value.to_bytes(_SCALAR_BYTES, "big")


def _scalar_to_private_key(scalar: bytes) -> ec.EllipticCurvePrivateKey:
    return ec.derive_private_key(int.from_bytes(scalar, "big"), _CURVE)


def _mask_shapes(state: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> list[tuple[int, ...]]:
    return [np.shape(arrays[key]) for key in state["keys"]] + [(1,), (1,)]


def setup(state: MutableMapping[str, Any], config: Mapping[str, Any], arrays: Any = None) -> dict[str, Any]:
    """Stage 1: store the protocol parameters, draw the two key pairs, reply with the public keys.

    ``config``: ``protocol-id`` (str, names this run of the protocol), ``node-id`` (this node's id), ``threshold``, ``clipping-range``,
    ``quantization-range``, ``modulus-range``, ``keys`` (the array keys, in the order the masks are drawn).
    The state of any other protocol run is discarded. Reply: ``{"pk1": bytes, "pk2": bytes}``.
    """
    _forget_secrets(state)
    sk1, pk1 = generate_key_pairs()
    sk2, pk2 = generate_key_pairs()
    state.update(
        {
            "stage": SETUP,
            "protocol-id": str(config["protocol-id"]),
            "nid": int(config["node-id"]),
            "threshold": int(config["threshold"]),
            "clipping-range": float(config["clipping-range"]),
            "quantization-range": int(config["quantization-range"]),
            "modulus-range": int(config["modulus-range"]),
            "keys": [str(k) for k in config["keys"]],
            "sk1": private_key_to_bytes(sk1),
            "pk1": public_key_to_bytes(pk1),
            "sk2": private_key_to_bytes(sk2),
            "pk2": public_key_to_bytes(pk2),
        }
    )
    return {"pk1": state["pk1"], "pk2": state["pk2"]}


def share_keys(state: MutableMapping[str, Any], config: Mapping[str, Any], arrays: Any = None) -> dict[str, Any]:
    """Stage 2: draw the self-mask seed, Shamir-share it and ``sk1``, encrypt one share pair per neighbour.

    ``config``: ``protocol-id``, ``nids`` (the neighbours that answered setup, this node included), ``pk1s``, ``pk2s``
    (their public keys, in the order of ``nids``). Reply: ``{"dsts": [node id], "ctxts": [bytes]}``, one Fernet
    ciphertext of ``(this node, dst, share of b, share of sk1)`` per other neighbour.

    Raises:
        SecAggError: wrong stage or protocol run, fewer than ``threshold`` neighbours, repeated public keys, or this
            node's own public keys shown wrongly.
    """
    _expect(state, config, SHARE_KEYS)
    nids = [int(n) for n in config["nids"]]
    pk1s, pk2s = list(config["pk1s"]), list(config["pk2s"])
    me, threshold = state["nid"], state["threshold"]
    if len(nids) < threshold:
        raise SecAggError(f"secagg {SHARE_KEYS}: {len(nids)} neighbours, fewer than the threshold {threshold}")
    if len(set(nids)) != len(nids) or len(set(pk1s + pk2s)) != 2 * len(nids):
        raise SecAggError(f"secagg {SHARE_KEYS}: repeated node ids or public keys")
    if me not in nids or (pk1s[nids.index(me)], pk2s[nids.index(me)]) != (state["pk1"], state["pk2"]):
        raise SecAggError(f"secagg {SHARE_KEYS}: this node's public keys are missing or wrong")
    seed = os.urandom(32)
    b_shares = create_shares(seed, threshold, len(nids))
    sk_shares = create_shares(_sk1_scalar(state["sk1"]), threshold, len(nids))
    sk2 = bytes_to_private_key(state["sk2"])
    dsts, ctxts, peer_keys = [], [], []
    for nid, pk2, b_share, sk_share in zip(nids, pk2s, b_shares, sk_shares):
        # the encryption key shared with nid (kept to decrypt nid's shares in the next stage, as Flower does)
        key = b"" if nid == me else generate_shared_key(sk2, bytes_to_public_key(pk2))
        peer_keys.append(key)
        if nid != me:
            dsts.append(nid)
            ctxts.append(encrypt(key, share_keys_plaintext_concat(me, nid, b_share, sk_share)))
    mine = nids.index(me)
    state.update(
        {
            "stage": SHARE_KEYS,
            "seed": seed,
            "peer-nids": nids,
            "peer-pk1s": pk1s,
            "peer-keys": peer_keys,
            "share-nids": [me],
            "b-shares": [b_shares[mine]],
            "sk-shares": [sk_shares[mine]],
        }
    )
    return {"dsts": dsts, "ctxts": ctxts}


def collect_masked_vectors(
    state: MutableMapping[str, Any],
    config: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    *,
    rng: np.random.Generator | None = None,
) -> dict[str, np.ndarray]:
    """Stage 3: store the neighbours' shares, reply with the quantized arrays masked (module docstring, stage 3).

    ``config``: ``protocol-id``, ``srcs`` (node ids) and ``ctxts`` (the ciphertexts they sent to this node).
    ``arrays``: ``{key: float array}`` with the setup's keys. ``rng``: the stochastic rounding's generator (fresh OS
    entropy when ``None``). Reply: ``{key: uint32 array}`` in ``[0, M)`` (``M <= 2**32``), the arrays' keys and shapes plus
    ``"secagg.count"`` and ``"secagg.clipped"`` (shape ``(1,)``), every one masked.

    Raises:
        SecAggError: wrong stage or protocol run, fewer than ``threshold - 1`` share pairs, a ciphertext that does not
            decrypt or names another source or destination, arrays with other keys than the setup's.
        ValueError: a non-finite input element.
    """
    _expect(state, config, COLLECT_MASKED_VECTORS)
    srcs, ctxts = [int(s) for s in config["srcs"]], list(config["ctxts"])
    me, threshold, modulus = state["nid"], state["threshold"], state["modulus-range"]
    if sorted(arrays) != sorted(state["keys"]):
        raise SecAggError(f"secagg {COLLECT_MASKED_VECTORS}: the arrays' keys are not the setup's keys")
    if len(srcs) + 1 < threshold or len(set(srcs)) != len(srcs) or me in srcs:
        raise SecAggError(f"secagg {COLLECT_MASKED_VECTORS}: {len(srcs)} share pairs, the threshold is {threshold}")
    peers = state["peer-nids"]
    sk1 = bytes_to_private_key(state["sk1"])
    b_shares, sk_shares, pk1_of = [], [], {}
    for src, ctxt in zip(srcs, ctxts):
        if src not in peers:
            raise SecAggError(f"secagg {COLLECT_MASKED_VECTORS}: shares from {src}, which is not a neighbour")
        index = peers.index(src)
        try:
            plain = decrypt(state["peer-keys"][index], ctxt)
        except Exception as err:  # cryptography.fernet.InvalidToken and malformed tokens
            raise SecAggError(f"secagg {COLLECT_MASKED_VECTORS}: the shares from {src} do not decrypt") from err
        actual_src, dst, b_share, sk_share = share_keys_plaintext_separate(plain)
        if (actual_src, dst) != (src, me):
            raise SecAggError(f"secagg {COLLECT_MASKED_VECTORS}: shares from {actual_src} to {dst}, sent as {src}")
        b_shares.append(b_share)
        sk_shares.append(sk_share)
        pk1_of[src] = state["peer-pk1s"][index]
    rng = np.random.default_rng() if rng is None else rng
    vector, clipped = [], 0
    for key in state["keys"]:
        q, n = quantize(arrays[key], state["clipping-range"], state["quantization-range"], rng)
        vector.append(q)
        clipped += n
    vector += [np.ones(1, dtype=np.int64), np.array([clipped], dtype=np.int64)]
    shapes = _mask_shapes(state, arrays)
    vector = parameters_addition(vector, pseudo_rand_gen(state["seed"], modulus, shapes))
    for src in srcs:
        mask = pseudo_rand_gen(generate_shared_key(sk1, bytes_to_public_key(pk1_of[src])), modulus, shapes)
        vector = parameters_addition(vector, mask) if me > src else parameters_subtraction(vector, mask)
        vector = parameters_mod(vector, modulus)
    vector = parameters_mod(vector, modulus)
    state.update(
        {
            "stage": COLLECT_MASKED_VECTORS,
            "share-nids": [me, *srcs],
            "b-shares": [*state["b-shares"], *b_shares],
            "sk-shares": [*state["sk-shares"], *sk_shares],
        }
    )
    return {key: v.astype(np.uint32) for key, v in zip([*state["keys"], COUNT_KEY, CLIPPED_KEY], vector)}


def unmask(state: MutableMapping[str, Any], config: Mapping[str, Any], arrays: Any = None) -> dict[str, Any]:
    """Stage 4: reply with the share of ``b`` of every active neighbour and of ``sk1`` of every dropped one.

    ``config``: ``protocol-id``, ``active`` (neighbours that sent a masked vector, this node included) and ``dead``
    (neighbours that shared keys but sent none). Reply: ``{"nids": active + dead, "shares": [bytes]}``. The node then
    forgets its secrets, so a second request in the same protocol run is refused.

    Raises:
        SecAggError: wrong stage or protocol run, ``active`` and ``dead`` overlap (that would give away both secrets of a
            node), a node this node holds no share of, this node listed as dead, or fewer than ``threshold`` active.
    """
    _expect(state, config, UNMASK)
    active, dead = [int(n) for n in config["active"]], [int(n) for n in config["dead"]]
    me, threshold = state["nid"], state["threshold"]
    held = state["share-nids"]
    if set(active) & set(dead) or len(set(active)) != len(active) or len(set(dead)) != len(dead):
        raise SecAggError(f"secagg {UNMASK}: the active and dropped lists overlap or repeat a node")
    if me not in active or not set(active + dead) <= set(held):
        raise SecAggError(f"secagg {UNMASK}: a listed node is not one this node holds shares of")
    if len(active) < threshold:
        raise SecAggError(f"secagg {UNMASK}: {len(active)} active neighbours, fewer than the threshold {threshold}")
    shares = [state["b-shares"][held.index(n)] for n in active] + [state["sk-shares"][held.index(n)] for n in dead]
    _forget_secrets(state)
    state["stage"] = UNMASK
    return {"nids": active + dead, "shares": shares}


HANDLERS = {SETUP: setup, SHARE_KEYS: share_keys, COLLECT_MASKED_VECTORS: collect_masked_vectors, UNMASK: unmask}


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
