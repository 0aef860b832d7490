"""Secure aggregation: in-process nodes run the client handlers of :mod:`fedrec_flwr.privacy.secagg`, the driver
sums through them, and the server's transcript is searched for any node's plain vector."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord

from fedrec_flwr.privacy import secagg
from fedrec_flwr.privacy.secagg import SecAggError, secure_sum


class FakeNodes:
    """Nodes in one process: each keeps its state in a ConfigRecord (as in ``context.state``), rebuilt from a plain
    dict between stages, so the state must survive Flower's record types. ``drop`` maps a node to the stage it no
    longer answers (it answers every stage before it). ``transcript`` is every reply the server received."""

    def __init__(self, inputs: dict[int, dict[str, np.ndarray]], *, drop=None, seed=0):
        self.inputs = inputs
        self.drop = dict(drop or {})
        self.states = {nid: ConfigRecord() for nid in inputs}
        self.seed = seed
        self.transcript: list[tuple[str, int, dict]] = []

    def __call__(self, stage, contents):
        replies = {}
        for nid, config in contents.items():
            if nid in self.drop and secagg.STAGES.index(stage) >= secagg.STAGES.index(self.drop[nid]):
                continue
            state = dict(self.states[nid])
            if stage == secagg.COLLECT_MASKED_VECTORS:
                rng = np.random.default_rng([self.seed, nid])
                reply = secagg.collect_masked_vectors(state, config, self.inputs[nid], rng=rng)
            else:
                reply = secagg.HANDLERS[stage](state, config, None)
            self.states[nid] = ConfigRecord(state)
            replies[nid] = reply
            self.transcript.append((stage, nid, reply))
        return replies


def _inputs(num_nodes, shapes, seed=1, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        100 + 7 * i: {key: (scale * rng.standard_normal(shape)).astype(np.float32) for key, shape in shapes.items()}
        for i in range(num_nodes)
    }


def _plain_sum(inputs, nodes, c):
    keys = next(iter(inputs.values()))
    return {key: sum(np.clip(inputs[n][key].astype(np.float64), -c, c) for n in nodes) for key in keys}


SHAPES = {"adversary.head.weight": (2, 64), "adversary.head.bias": (2,), "counts": (1682,), "scalar": ()}


@pytest.mark.parametrize("num_nodes", [3, 5, 10])
def test_secure_sum_equals_the_plain_sum_within_the_quantization_bound(num_nodes):
    inputs = _inputs(num_nodes, SHAPES)
    nodes = FakeNodes(inputs)
    spec = {key: np.shape(a) for key, a in next(iter(inputs.values())).items()}
    out = secure_sum(nodes, list(inputs), spec, threshold=2, clipping_range=8.0, quantization_range=2**16)
    step = 16.0 / (2**16 - 1)
    assert out.error_bound == pytest.approx(num_nodes * step)
    assert out.contributors == tuple(sorted(inputs)) and out.num_contributors == num_nodes
    assert out.clipped == 0
    plain = _plain_sum(inputs, inputs, 8.0)
    for key, value in plain.items():
        assert out.arrays[key].shape == value.shape
        err = np.max(np.abs(out.arrays[key] - value))
        assert err <= out.error_bound
        assert err > 0  # the quantization is really there (the bound is not vacuous)


def test_a_coarse_grid_shows_an_error_of_the_order_of_the_step_and_never_above_the_bound():
    inputs = _inputs(6, {"v": (4000,)})
    out = secure_sum(
        FakeNodes(inputs), list(inputs), {"v": (4000,)}, threshold=3, clipping_range=4.0, quantization_range=9
    )
    err = np.abs(out.arrays["v"] - _plain_sum(inputs, inputs, 4.0)["v"])
    assert err.max() <= out.error_bound == pytest.approx(6 * 1.0)
    assert err.max() > 1.0  # coarse: well above one step, as the sum of 6 independent roundings
    assert abs(float(np.mean(out.arrays["v"] - _plain_sum(inputs, inputs, 4.0)["v"]))) < 0.05  # unbiased


def test_integer_counts_are_summed_exactly_on_an_aligned_grid():
    rng = np.random.default_rng(2)
    inputs = {1 + i: {"counts": (rng.random(1682) < 0.06).astype(np.float64)} for i in range(8)}
    out = secure_sum(
        FakeNodes(inputs),
        list(inputs),
        {"counts": (1682,)},
        threshold=5,
        clipping_range=1.0,
        quantization_range=2**22 + 1,
    )
    np.testing.assert_array_equal(out.arrays["counts"], sum(x["counts"] for x in inputs.values()))


def test_clipping_is_reported_as_a_total_only():
    inputs = _inputs(4, {"v": (50,)}, scale=3.0)
    out = secure_sum(FakeNodes(inputs), list(inputs), {"v": (50,)}, threshold=2, clipping_range=1.0)
    expected = sum(int(np.count_nonzero(np.abs(x["v"]) > 1.0)) for x in inputs.values())
    assert out.clipped == expected > 0
    assert np.max(np.abs(out.arrays["v"] - _plain_sum(inputs, inputs, 1.0)["v"])) <= out.error_bound


@pytest.mark.parametrize("stage", [secagg.SHARE_KEYS, secagg.COLLECT_MASKED_VECTORS])
def test_nodes_dropped_mid_protocol_leave_the_sum_of_the_survivors(stage):
    inputs = _inputs(7, SHAPES)
    ids = sorted(inputs)
    gone = {ids[1]: stage, ids[4]: stage, ids[6]: stage}  # 4 survive; threshold 4
    nodes = FakeNodes(inputs, drop=gone)
    spec = {key: np.shape(a) for key, a in inputs[ids[0]].items()}
    out = secure_sum(nodes, ids, spec, threshold=4, clipping_range=8.0)
    survivors = [n for n in ids if n not in gone]
    assert out.contributors == tuple(survivors)
    plain = _plain_sum(inputs, survivors, 8.0)
    for key in plain:
        assert np.max(np.abs(out.arrays[key] - plain[key])) <= out.error_bound


def test_a_node_dropped_at_unmask_still_contributes():
    inputs = _inputs(5, {"v": (66,)})
    ids = sorted(inputs)
    out = secure_sum(
        FakeNodes(inputs, drop={ids[2]: secagg.UNMASK}), ids, {"v": (66,)}, threshold=3, clipping_range=8.0
    )
    assert out.contributors == tuple(ids)
    assert np.max(np.abs(out.arrays["v"] - _plain_sum(inputs, ids, 8.0)["v"])) <= out.error_bound


@pytest.mark.parametrize("stage", secagg.STAGES)
def test_fewer_survivors_than_the_threshold_raise_one_line(stage):
    inputs = _inputs(6, {"v": (10,)})
    ids = sorted(inputs)
    nodes = FakeNodes(inputs, drop={n: stage for n in ids[:3]})  # 3 left, threshold 4
    with pytest.raises(SecAggError, match=r"3 of 6 nodes left after stage .*threshold is 4") as err:
        secure_sum(nodes, ids, {"v": (10,)}, threshold=4, clipping_range=8.0)
    assert "\n" not in str(err.value)


def test_an_altered_share_fails_loudly():
    inputs = _inputs(4, {"v": (5,)})

    class Altering(FakeNodes):
        def __call__(self, stage, contents):
            replies = super().__call__(stage, contents)
            if stage == secagg.UNMASK:
                for reply in replies.values():
                    reply["shares"] = [share[:4] + bytes(len(share) - 4) for share in reply["shares"]]
            return replies

    with pytest.raises(SecAggError, match="do not combine|contributor count"):
        secure_sum(Altering(inputs), list(inputs), {"v": (5,)}, threshold=3, clipping_range=8.0)


def test_secagg_plus_sparse_neighbourhoods_with_drops():
    inputs = _inputs(30, {"v": (130,)})
    ids = sorted(inputs)
    gone = {ids[3]: secagg.COLLECT_MASKED_VECTORS, ids[17]: secagg.SHARE_KEYS}
    nodes = FakeNodes(inputs, drop=gone)
    out = secure_sum(nodes, ids, {"v": (130,)}, threshold=4, clipping_range=8.0, num_shares=7, seed=3)
    survivors = [n for n in ids if n not in gone]
    assert out.contributors == tuple(survivors)
    assert np.max(np.abs(out.arrays["v"] - _plain_sum(inputs, survivors, 8.0)["v"])) <= out.error_bound
    # a node of the sparse graph shares keys with its 6 neighbours only
    (share_keys_reply,) = [r for s, n, r in nodes.transcript if s == secagg.SHARE_KEYS and n == ids[0]]
    assert len(share_keys_reply["dsts"]) == 6


def test_a_malformed_masked_vector_counts_as_a_drop(caplog):
    inputs = _inputs(5, {"v": (20,)})
    bad = sorted(inputs)[2]

    class Malformed(FakeNodes):
        def __call__(self, stage, contents):
            replies = super().__call__(stage, contents)
            if stage == secagg.COLLECT_MASKED_VECTORS:
                replies[bad] = {**replies[bad], "v": replies[bad]["v"][:-1]}
            return replies

    out = secure_sum(Malformed(inputs), sorted(inputs), {"v": (20,)}, threshold=3, clipping_range=8.0)
    survivors = [n for n in sorted(inputs) if n != bad]
    assert out.contributors == tuple(survivors) and f"node {bad} sent a malformed masked vector" in caplog.text
    assert np.max(np.abs(out.arrays["v"] - _plain_sum(inputs, survivors, 8.0)["v"])) <= out.error_bound


def test_the_server_transcript_never_holds_a_plain_vector():
    inputs = _inputs(4, {"w": (2, 64), "b": (2,)}, scale=0.5)
    nodes = FakeNodes(inputs, drop={max(inputs): secagg.COLLECT_MASKED_VECTORS})
    out = secure_sum(nodes, list(inputs), {"w": (2, 64), "b": (2,)}, threshold=2, clipping_range=2.0)
    assert out.num_contributors == 3
    c, q = 2.0, 2**22
    step = 2 * c / (q - 1)
    plain_quantized = [(x[k].astype(np.float64) + c) / step for x in inputs.values() for k in x]
    plain = [x[k].astype(np.float64) for x in inputs.values() for k in x]
    received = []
    for _stage, _nid, reply in nodes.transcript:
        for value in reply.values():
            values = value if isinstance(value, list) else [value]
            for v in values:
                received.append(np.frombuffer(v, dtype=np.uint8) if isinstance(v, bytes) else np.asarray(v))
    masked = [np.asarray(v) for s, _n, r in nodes.transcript if s == secagg.COLLECT_MASKED_VECTORS for v in r.values()]
    assert len(masked) == 3 * 4 and all(r.dtype == np.uint32 for r in masked)  # 3 survivors x (2 arrays + 2 slots)
    for r in received:
        for p in [*plain, *plain_quantized]:
            if r.shape == p.shape:
                assert not np.allclose(r, p, rtol=0, atol=max(1e-3 * float(np.max(np.abs(p))), 1e-6))
    for r in masked:  # a masked vector is uniform on [0, M): far from any input, dequantized or not
        for p in plain_quantized:
            if r.shape == p.shape:
                assert np.median(np.abs(r - p)) > 1e6
    # the count and clipped slots travel masked too: never the small integers they hide
    for stage, _nid, reply in nodes.transcript:
        if stage == secagg.COLLECT_MASKED_VECTORS:
            assert int(reply[secagg.COUNT_KEY][0]) > 1000 and int(reply[secagg.CLIPPED_KEY][0]) > 1000


def test_the_sum_is_deterministic_given_the_seeds_although_the_masks_are_fresh():
    inputs = _inputs(5, {"v": (66,)})
    runs = []
    for _ in range(2):
        nodes = FakeNodes(inputs, drop={min(inputs): secagg.COLLECT_MASKED_VECTORS}, seed=9)
        out = secure_sum(nodes, list(inputs), {"v": (66,)}, threshold=2, clipping_range=8.0, num_shares=3, seed=5)
        masked = [r["v"] for s, _n, r in nodes.transcript if s == secagg.COLLECT_MASKED_VECTORS]
        runs.append((out, masked))
    (a, masked_a), (b, masked_b) = runs
    assert np.array_equal(a.arrays["v"], b.arrays["v"]) and a.contributors == b.contributors
    assert not np.array_equal(masked_a[0], masked_b[0])  # fresh keys and seeds: other masks, same sum


def test_quantize_bound_and_clip_count_by_hand():
    rng = np.random.default_rng(0)
    x = np.array([-3.0, -1.0, 0.0, 0.3, 1.0, 2.5])
    q, clipped = secagg.quantize(x, 1.0, 5, rng)  # grid -1, -0.5, 0, 0.5, 1
    assert clipped == 2
    assert q.dtype == np.int64 and q.min() >= 0 and q.max() <= 4
    assert list(q[[0, 1, 2, 4, 5]]) == [0, 0, 2, 4, 4]  # grid points and clipped values are exact
    assert q[3] in (2, 3)
    np.testing.assert_allclose(secagg.dequantize(np.array([2 + 4]), 2, 1.0, 5), [1.0])
    with pytest.raises(ValueError, match="non-finite"):
        secagg.quantize(np.array([np.nan]), 1.0, 5, rng)


def _run_until(stage, nids=(1, 2, 3), threshold=2):
    """Node states after the stages before ``stage``, driven by hand; returns (states, configs of ``stage``)."""
    inputs = {n: {"v": np.zeros(3)} for n in nids}
    states = {n: {} for n in nids}
    common = {"protocol-id": "s", "threshold": threshold, "clipping-range": 1.0, "quantization-range": 16}
    pks = {n: secagg.setup(states[n], {**common, "modulus-range": 2**8, "keys": ["v"], "node-id": n}) for n in nids}
    if stage == secagg.SHARE_KEYS:
        return states, inputs, pks
    cfg = {"protocol-id": "s", "nids": list(nids), "pk1s": [pks[n]["pk1"] for n in nids]}
    cfg["pk2s"] = [pks[n]["pk2"] for n in nids]
    shares = {n: secagg.share_keys(states[n], cfg) for n in nids}
    collect = {}
    for n in nids:
        srcs = [s for s in nids if s != n]
        collect[n] = {
            "protocol-id": "s",
            "srcs": srcs,
            "ctxts": [shares[s]["ctxts"][shares[s]["dsts"].index(n)] for s in srcs],
        }
    return states, inputs, collect


def test_a_node_refuses_to_give_both_shares_of_a_node_or_to_unmask_twice():
    states, inputs, collect = _run_until(secagg.COLLECT_MASKED_VECTORS)
    for n in states:
        secagg.collect_masked_vectors(states[n], collect[n], inputs[n])
    with pytest.raises(SecAggError, match="overlap"):
        secagg.unmask(states[1], {"protocol-id": "s", "active": [1, 2], "dead": [2]})
    secagg.unmask(states[1], {"protocol-id": "s", "active": [1, 2, 3], "dead": []})
    assert not {"sk1", "sk2", "seed", "peer-keys", "b-shares", "sk-shares"} & set(states[1])  # secrets forgotten
    with pytest.raises(SecAggError, match="stage"):
        secagg.unmask(states[1], {"protocol-id": "s", "active": [1, 2, 3], "dead": []})


def test_a_node_rejects_out_of_order_stages_other_protocol_runs_and_forged_shares():
    states, inputs, collect = _run_until(secagg.COLLECT_MASKED_VECTORS)
    with pytest.raises(SecAggError, match="protocol run"):
        secagg.collect_masked_vectors(states[1], {**collect[1], "protocol-id": "other"}, inputs[1])
    with pytest.raises(SecAggError, match="stage"):
        secagg.unmask(states[1], {"protocol-id": "s", "active": [1, 2, 3], "dead": []})
    forged = {**collect[1], "ctxts": [collect[1]["ctxts"][0][:-4] + b"AAAA", collect[1]["ctxts"][1]]}
    with pytest.raises(SecAggError, match="do not decrypt"):
        secagg.collect_masked_vectors(states[1], forged, inputs[1])
    swapped = {**collect[1], "ctxts": collect[1]["ctxts"][::-1]}
    with pytest.raises(SecAggError):
        secagg.collect_masked_vectors(states[1], swapped, inputs[1])


def test_share_keys_checks_its_own_keys_and_the_threshold():
    states, _inputs_, pks = _run_until(secagg.SHARE_KEYS, threshold=3)
    nids = [1, 2, 3]
    cfg = {
        "protocol-id": "s",
        "nids": nids,
        "pk1s": [pks[n]["pk1"] for n in nids],
        "pk2s": [pks[n]["pk2"] for n in nids],
    }
    with pytest.raises(SecAggError, match="threshold"):
        secagg.share_keys(states[1], {**cfg, "nids": [1, 2], "pk1s": cfg["pk1s"][:2], "pk2s": cfg["pk2s"][:2]})
    with pytest.raises(SecAggError, match="own public keys|missing or wrong"):
        secagg.share_keys(states[1], {**cfg, "pk1s": [cfg["pk1s"][1], cfg["pk1s"][0], cfg["pk1s"][2]]})
    reply = secagg.share_keys(states[1], cfg)
    assert reply["dsts"] == [2, 3] and all(isinstance(c, bytes) for c in reply["ctxts"])


def test_secure_sum_rejects_inconsistent_parameters():
    send = FakeNodes({1: {"v": np.zeros(1)}, 2: {"v": np.zeros(1)}})
    with pytest.raises(ValueError, match="modulus_range"):
        secure_sum(send, [1, 2], {"v": (1,)}, threshold=2, clipping_range=1.0, quantization_range=2**31 + 1)
    with pytest.raises(ValueError, match="threshold"):
        secure_sum(send, [1, 2], {"v": (1,)}, threshold=3, clipping_range=1.0)
    with pytest.raises(ValueError, match="must not start"):
        secure_sum(send, [1, 2], {"secagg.count": (1,)}, threshold=2, clipping_range=1.0)


# ---------------------------------------------------------------------------------------------------------------
# on Flower messages: a ClientApp with the "secagg" query, run by the in-process SerialGrid


def _secagg_client_app(inputs):
    from flwr.app import Message
    from flwr.clientapp import ClientApp

    from fedrec_flwr.privacy import secagg_records

    app = ClientApp()

    @app.query(secagg_records.ACTION)
    def secagg_query(message, context):
        arrays = lambda: inputs[context.node_id]
        rng = np.random.default_rng([0, context.node_id])
        return Message(secagg_records.answer(message.content, context.state, arrays, rng=rng), reply_to=message)

    return app


def test_secure_sum_over_flower_messages_with_a_node_stopped_mid_protocol(task_identity):
    from fedrec_flwr.privacy.secagg_records import grid_sender
    from fedrec_flwr.serial import SerialGrid

    rng = np.random.default_rng(4)
    inputs = {
        1000 + k: {"w": rng.standard_normal((2, 64)), "n": rng.integers(0, 5, 1682).astype(float)} for k in range(5)
    }
    grid = SerialGrid(_secagg_client_app(inputs), 5, {})
    send = grid_sender(grid)
    stops = []

    def send_and_stop(stage, contents):
        if stage == secagg.COLLECT_MASKED_VECTORS:
            stops.append(grid.stop_node(1003))  # shared its keys, then died: an error reply from now on
        return send(stage, contents)

    out = secure_sum(send_and_stop, sorted(inputs), {"w": (2, 64), "n": (1682,)}, threshold=3, clipping_range=8.0)
    survivors = [n for n in sorted(inputs) if n != 1003]
    assert out.contributors == tuple(survivors)
    for key in ("w", "n"):
        plain = sum(inputs[n][key] for n in survivors)
        assert np.max(np.abs(out.arrays[key] - plain)) <= out.error_bound
    state = stops[0].state.config_records["secagg"]
    assert state["stage"] == secagg.SHARE_KEYS and "sk1" in state  # its secrets stayed in its context.state
    for nid in survivors:  # the survivors answered unmask and forgot their secrets
        assert "sk1" not in grid.contexts[nid].state.config_records["secagg"]


def test_a_malformed_or_erroring_node_counts_as_dropped(task_identity):
    from fedrec_flwr.privacy.secagg_records import from_content, grid_sender, to_content
    from fedrec_flwr.serial import SerialGrid

    inputs = {1000 + k: {"v": np.full(3, float(k))} for k in range(4)}
    inputs[1002] = {"v": np.full(3, np.nan)}  # fails on the node: an error reply at the masked-vector stage
    grid = SerialGrid(_secagg_client_app(inputs), 4, {})
    out = secure_sum(grid_sender(grid), sorted(inputs), {"v": (3,)}, threshold=3, clipping_range=8.0)
    assert out.contributors == (1000, 1001, 1003)
    np.testing.assert_allclose(out.arrays["v"], np.full(3, 4.0), atol=out.error_bound)
    stage, payload = from_content(to_content(secagg.UNMASK, {"nids": [1, 2], "shares": [b"a", b"b"]}))
    assert stage == secagg.UNMASK and payload == {"nids": [1, 2], "shares": [b"a", b"b"]}
