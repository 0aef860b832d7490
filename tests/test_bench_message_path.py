"""The per-message path of a one-user node stays on its fast kernels: what the profile of one message in a
simulation worker (``experiments/bench/profile_message.py``) found, checked so it cannot silently come back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_run_config
from flwr.app import RecordDict

from fedrec_flwr.app.runtime import build_shared_model, get_runtime
from fedrec_flwr.local import block_engine, block_optim, blocks
from fedrec_flwr.registry import resolve

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _train(mapping, users, fused: bool):
    runtime = get_runtime(mapping)
    cls = resolve("client", runtime.config.client)
    shared = {
        k: v.detach().numpy().copy()
        for k, v in build_shared_model(runtime.config, runtime.split.num_items).shared_state().items()
    }
    old, block_optim.FUSED_ADAM = block_optim.FUSED_ADAM, fused
    try:
        state = RecordDict()
        updates = blocks.train_block(runtime, cls, users, state, shared, {"server-round": 1})
    finally:
        block_optim.FUSED_ADAM = old
    return updates


@pytest.mark.parametrize("users", [[0], [0, 1, 2]])
def test_ncf_blocks_step_with_the_fused_adam_kernel(tmp_path, monkeypatch, users):
    """NCF's MLP weights enter ``batched_loss`` transposed, so autograd hands back transposed (non-contiguous)
    gradients; the fused kernel must still be used (it was silently skipped for every NCF block: 4.7 of 15 ms per
    one-user train message went to the eight-pass formula), with the same updates as the formula up to float32
    rounding."""
    mapping = tiny_run_config(tmp_path, optimizer="adam", model="ncf")
    calls = []
    real = torch._fused_adam_

    def counting(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adam_", counting)
    fused = _train(mapping, users, fused=True)
    assert calls and all(
        n == len(get_runtime(mapping).layout.private_keys) + len(get_runtime(mapping).layout.shared_shapes)
        for n in calls
    )
    calls.clear()
    formula = _train(mapping, users, fused=False)
    assert not calls
    for a, b in zip(fused, formula):
        for key in a.dense:
            np.testing.assert_allclose(a.dense[key], b.dense[key], rtol=2e-4, atol=2e-6, err_msg=key)
        for key, (rows, values) in a.rows.items():
            np.testing.assert_array_equal(rows, b.rows[key][0])
            np.testing.assert_allclose(values, b.rows[key][1], rtol=2e-4, atol=2e-6, err_msg=key)


@pytest.mark.parametrize(
    ("rows", "ok"), [([1, 4, 7], True), ([7, 1, 4], True), ([1, 4, 4], False), ([4, 1, 4], False), ([2], True)]
)
def test_a_contribution_refuses_repeated_rows_sorted_or_not(tmp_path, rows, ok):
    """``Contribution.add_user`` skips the sort for strictly increasing rows (what clients send) and still refuses a
    repeated row in any order."""
    from fedrec_flwr.wire import ROWS, Contribution, ReplyError

    layout = get_runtime(tiny_run_config(tmp_path)).layout
    dense = {key: np.zeros(layout.shared_shapes[key], np.float32) for key in layout.dense_keys}
    ids = np.asarray(rows, dtype=np.int64)
    item_rows = {key: (ids, np.ones((len(ids), layout.shared_shapes[key][1]), np.float32)) for key in layout.item_keys}
    contribution = Contribution(layout)
    if ok:
        contribution.add_user(dense, item_rows, 3, 0.5)
        packed = contribution.pack()
        key = layout.item_keys[0]
        np.testing.assert_array_equal(packed[key + ROWS], np.sort(ids))
    else:
        with pytest.raises(ReplyError, match="unique"):
            contribution.add_user(dense, item_rows, 3, 0.5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None])
def test_the_parameter_check_names_exactly_the_non_finite_users(bad):
    """The block's parameter check (a fused norm first, the per-user check only when a norm is not finite) raises
    for a NaN or infinite entry naming that user, and not for finite entries whose norm overflows float32."""
    params = {"a": torch.full((3, 4, 2), 3e30), "b": torch.zeros(3, 5)}  # ||a|| overflows float32: finite entries
    if bad is None:
        block_engine.check_finite_parameters([10, 11, 12], params, "parameters")
        return
    params["b"][1, 2] = bad
    with pytest.raises(FloatingPointError, match=r"users \[11\]"):
        block_engine.check_finite_parameters([10, 11, 12], params, "parameters")


def _full_table_pack(layout, users):
    """The reply packed the straightforward, slow way: every user's rows added into full ``(num_items, d)`` float64
    tables, the touched rows read back. The reference for :class:`Contribution`."""
    out = {}
    for key in layout.item_keys:
        shape = layout.shared_shapes[key]
        table, count = np.zeros(shape, np.float64), np.zeros(shape[0], np.float64)
        for _, rows, _, _ in users:
            ids, values = rows[key]
            table[ids] += values
            count[ids] += 1.0
        touched = np.flatnonzero(count > 0).astype(np.int64)
        out[key + "#rows"], out[key + "#sum"], out[key + "#count"] = (
            touched,
            table[touched].astype(np.float32),
            count[touched].astype(np.float32),
        )
    return out


@pytest.mark.parametrize("num_users", [1, 2, 7])
def test_a_contribution_packs_the_full_table_reply_bit_for_bit_without_building_the_table(num_users):
    """``Contribution`` sums each user's touched rows only (the full tables cost about 1 ms per one-user message):
    the packed rows, sums (signed zeros included) and counts equal the full-table form bit for bit, for unsorted and
    overlapping rows; and packing one user of a 100,000-row table allocates far less than one such table (25.6 MB
    in float64; the old form allocated two)."""
    import tracemalloc

    from fedrec_flwr.wire import Contribution, ModelLayout

    rng = np.random.default_rng(num_users)
    layout = ModelLayout(
        shared_shapes={"items.weight": (100_000, 32), "mlp.weight": (4, 3)},
        item_keys=("items.weight",),
        private_keys=("user.weight",),
    )
    users = []
    for _ in range(num_users):
        ids = rng.choice(300, size=int(rng.integers(1, 200)), replace=False)  # overlapping, unsorted
        values = rng.normal(size=(len(ids), 32)).astype(np.float32)
        values[0, :3] = [-0.0, 0.0, np.float32(1e-30)]
        users.append(
            (
                {"mlp.weight": rng.normal(size=(4, 3)).astype(np.float32)},
                {"items.weight": (ids, values)},
                int(rng.integers(1, 500)),
                float(rng.random()),
            )
        )
    contribution = Contribution(layout)
    tracemalloc.start()
    for user in users:
        contribution.add_user(*user)
    packed = contribution.pack()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    for key, expected in _full_table_pack(layout, users).items():
        assert packed[key].dtype == expected.dtype and packed[key].shape == expected.shape
        assert packed[key].tobytes() == expected.tobytes(), key  # bit for bit, signed zeros included
    assert peak < 5_000_000, peak


def test_a_contribution_refuses_rows_outside_the_table():
    """Without the full table an out-of-range row no longer raises numpy's IndexError (nor wraps around when
    negative): the contribution refuses it by name."""
    from fedrec_flwr.wire import Contribution, ModelLayout, ReplyError

    layout = ModelLayout(shared_shapes={"items.weight": (5, 2)}, item_keys=("items.weight",), private_keys=())
    for bad in ([4, 5], [-1, 2]):
        with pytest.raises(ReplyError, match="must be in"):
            Contribution(layout).add_user({}, {"items.weight": (np.array(bad), np.ones((2, 2), np.float32))}, 1, 0.0)


def test_get_runtime_reuses_the_last_runtime_only_for_the_same_config_value_and_type(tmp_path):
    """The per-message lookup skips the sorted key when the config equals the previous one; a config that differs
    only by a value's type (``1`` and ``1.0`` compare equal) or by a value still gets its own lookup."""
    from fedrec_flwr.app import runtime as runtime_module

    mapping = tiny_run_config(tmp_path)
    first = get_runtime(mapping)
    assert get_runtime(dict(mapping)) is first
    keys = []
    real = runtime_module.RunConfig.from_mapping
    try:
        runtime_module.RunConfig.from_mapping = staticmethod(lambda m: keys.append(dict(m)) or real(m))
        assert get_runtime(dict(mapping)) is first and keys == []
        changed = {**mapping, "seed": int(mapping.get("seed", 0)) + 1}
        assert get_runtime(changed) is not first and len(keys) == 1
        assert get_runtime(dict(mapping)) is first  # back to the cached first config: no new validation
        assert len(keys) == 1
        typed = {**mapping, "local-epochs": float(mapping["local-epochs"])}  # equal in Python, not the same config
        try:
            get_runtime(typed)
        except Exception:  # noqa: BLE001 - refused or accepted, it must have been validated
            pass
        assert len(keys) == 2
    finally:
        runtime_module.RunConfig.from_mapping = real


def test_one_user_block_steps_equal_with_one_shared_step_tensor(tmp_path):
    """``BlockAdam.step`` hands the fused kernel one step-count tensor for all parameters (it reads them, never
    writes them): one user's updates equal those with a clone per parameter, bit for bit."""
    mapping = tiny_run_config(tmp_path, optimizer="adam", model="ncf")
    first = _train(mapping, [0], fused=True)
    original = torch._fused_adam_

    def with_clones(params, grads, m, v, maxv, steps, **kwargs):
        return original(params, grads, m, v, maxv, [s.clone() for s in steps], **kwargs)

    torch._fused_adam_ = with_clones
    try:
        second = _train(mapping, [0], fused=True)
    finally:
        torch._fused_adam_ = original
    for a, b in zip(first, second):
        for key in a.dense:
            assert np.array_equal(a.dense[key], b.dense[key])
        for key in a.rows:
            assert np.array_equal(a.rows[key][1], b.rows[key][1])


@pytest.mark.parametrize(
    ("rows", "ok"),
    [
        ([1, 4, 7], True),
        ([7, 1, 4], True),
        ([1, 4, 4], False),
        ([4, 1, 4], False),
        ([0], True),
        ([9], True),
        ([10], False),
        ([-1, 3], False),
        ([3, 10], False),
        ([10, 3], False),
        ([-1], False),
    ],
)
def test_the_reply_check_takes_sorted_rows_without_a_sort_and_still_refuses_bad_ones(rows, ok):
    """``check_reply_keys`` reads the extremes of strictly increasing rows (what nodes send) off their ends instead of
    sorting them; repeated or out-of-range rows are refused in any order."""
    from fedrec_flwr.wire import COUNT, ROWS, SUM, ModelLayout, ReplyError, check_reply_keys

    layout = ModelLayout(shared_shapes={"items.weight": (10, 2)}, item_keys=("items.weight",), private_keys=())
    ids = np.asarray(rows, dtype=np.int64)
    reply = {
        "items.weight" + ROWS: ids,
        "items.weight" + SUM: np.ones((len(ids), 2), np.float32),
        "items.weight" + COUNT: np.ones(len(ids), np.float32),
    }
    if ok:
        check_reply_keys(reply, layout)
    else:
        with pytest.raises(ReplyError, match="unique row ids"):
            check_reply_keys(reply, layout)


@pytest.mark.parametrize("users", [1, 3])
def test_the_block_gather_is_each_users_rows(users):
    """``_gather`` (one user: no offsets) returns each user's table rows at its local indices, bit for bit."""
    generator = torch.Generator().manual_seed(users)
    table = torch.randn(users, 7, 4, generator=generator)
    index = torch.randint(0, 7, (users, 11), generator=generator)
    out = block_engine.gather_rows(table, index)
    expected = torch.stack([table[u][index[u]] for u in range(users)])
    assert torch.equal(out, expected)
