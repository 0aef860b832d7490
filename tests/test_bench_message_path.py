"""The per-message path of a one-user node stays on its fast kernels (issue 17): what the profile of one message in a
simulation worker (``experiments/bench/profile_message.py``) found, checked so it cannot silently come back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from conftest import tiny_run_config
from fedrec_flwr import blocks
from fedrec_flwr.registry import resolve
from fedrec_flwr.runtime import build_shared_model, get_runtime

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _train(mapping, users, fused: bool):
    runtime = get_runtime(mapping)
    cls = resolve("client", runtime.config.client)
    shared = {k: v.detach().numpy().copy() for k, v in
              build_shared_model(runtime.config, runtime.split.num_items).shared_state().items()}
    old, blocks.FUSED_ADAM = blocks.FUSED_ADAM, fused
    try:
        state = RecordDict()
        updates = blocks.train_block(runtime, cls, users, state, shared, {"server-round": 1})
    finally:
        blocks.FUSED_ADAM = old
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
    assert calls and all(n == len(get_runtime(mapping).layout.private_keys) + len(
        get_runtime(mapping).layout.shared_shapes) for n in calls)
    calls.clear()
    formula = _train(mapping, users, fused=False)
    assert not calls
    for a, b in zip(fused, formula):
        for key in a.dense:
            np.testing.assert_allclose(a.dense[key], b.dense[key], rtol=2e-4, atol=2e-6, err_msg=key)
        for key, (rows, values) in a.rows.items():
            np.testing.assert_array_equal(rows, b.rows[key][0])
            np.testing.assert_allclose(values, b.rows[key][1], rtol=2e-4, atol=2e-6, err_msg=key)


@pytest.mark.parametrize(("rows", "ok"), [([1, 4, 7], True), ([7, 1, 4], True), ([1, 4, 4], False),
                                          ([4, 1, 4], False), ([2], True)])
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
        blocks._check_finite_parameters([10, 11, 12], params, "parameters")
        return
    params["b"][1, 2] = bad
    with pytest.raises(FloatingPointError, match=r"users \[11\]"):
        blocks._check_finite_parameters([10, 11, 12], params, "parameters")
