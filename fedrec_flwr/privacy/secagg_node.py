"""SecAgg+'s node side: the four stage handlers (pure functions of a state mapping and a config) and the
quantization they share with the server driver.

The protocol, its parameters, its quantization bound and its limitations are described in
:mod:`fedrec_flwr.privacy.secagg`, which also holds the server driver (:func:`fedrec_flwr.privacy.secagg.secure_sum`)
and re-exports every public name of this module.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.common.secure_aggregation.crypto.shamir import create_shares
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
