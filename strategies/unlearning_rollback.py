"""``unlearning = "rollback"``: history-based client unlearning in the phase (:mod:`fedrec_flwr.unlearning.rollback`
has the method, FRU's rollback and FedEraser's calibration, with their sources), over the contributions the strategy
stored (``unlearning-history``, :mod:`.history_recording`).

* **Plain rollback** (``rollback-calibration-every = 0``): the model after the phase's round is ``theta_T`` plus
  :func:`~fedrec_flwr.unlearning.rollback.rollback_correction`, the difference between every stored round's
  aggregate without and with the forgotten users; for the parameter-averaging strategy ``theta_T = theta_0 + sum_t
  Delta_t`` (up to float32 rounding), so this is :func:`~fedrec_flwr.unlearning.rollback.rollback`'s replay without
  its float64 re-summation, and a forget set that never trained leaves the model bit for bit as it was. No message.
* **FedEraser's calibration** (``rollback-calibration-every = N > 0``): the stored rounds are replayed from the
  parameters before the first of them (:func:`~fedrec_flwr.unlearning.rollback.rollback`); before every ``N``-th
  stored round (the first included) the round's remaining stored users train once from the unlearned model (one
  train message per node, numbered after the run's last round, as ``continue``'s rounds are) and each stored update
  takes its fresh update's length per item table and dense key. The users train with the run's own local-training
  keys (ours: FedEraser trains fewer local epochs for calibration). Their private embeddings keep that training, as
  in any training round.
* ``rollback-tuning-rounds`` more training rounds of the remaining users follow (:func:`.unlearning_baselines.
  continue_training`), numbered after the calibration rounds.

Afterwards the forgotten users' stored contributions are deleted from the store (FRU keeps no update of a user who
left). The phase reports the store's size, the calibrated rounds and the messages sent.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType
from flwr.serverapp import Grid

from fedrec_flwr.arrays import decode_record
from fedrec_flwr.unlearning.aggregate import UserDelta
from fedrec_flwr.unlearning.history import delta_from_reply
from fedrec_flwr.unlearning.rollback import rollback, rollback_correction

from .history_recording import user_uploads
from .sampling import calibration_rounds
from .unlearning_baselines import continue_training
from .unlearning_transport import UnlearningFailed, payload_bytes


def rollback_phase(phase, grid: Grid, arrays: ArrayRecord, report: dict) -> ArrayRecord:
    """The phase of ``unlearning = "rollback"`` (module docstring) on ``arrays`` (the shared parameters after the
    phase's round); returns the new arrays and fills ``report``.

    Raises:
        UnlearningFailed: the strategy stored no history, or a node failed during a calibration round.
    """
    strategy, s = phase.strategy, phase.settings
    store = strategy.contribution_log
    if store is None:
        raise UnlearningFailed("unlearning = 'rollback' needs the stored contributions (unlearning-history)")
    history = store.history
    forget = [int(u) for u in s.forget]
    report["history"] = store.storage()
    report["history-rounds"] = history.rounds()
    report["rollback-calibration-every"] = s.rollback_calibration_every
    if s.rollback_calibration_every == 0 or store.start is None:
        theta = {k: v.numpy().astype(np.float64) for k, v in arrays.items()}
        correction = rollback_correction(history, forget)
        new = {k: theta[k] + correction[k] for k in theta}
        report["calibrated-rounds"] = []
    else:
        calibrated: list[int] = []

        def calibrate(server_round: int, theta: dict, remaining: np.ndarray):
            index = history.rounds().index(server_round)
            if index % s.rollback_calibration_every or not remaining.size:
                return None
            calibrated.append(server_round)
            return fresh_updates(phase, grid, theta, remaining, strategy.num_rounds + len(calibrated))

        new = rollback(store.start, history, forget, calibrate=calibrate)
        report["calibrated-rounds"] = calibrated
    out = ArrayRecord({k: Array(np.asarray(new[k], dtype=np.float32)) for k in phase.layout.shared_shapes})
    report["update-norm"] = float(
        np.sqrt(sum(np.sum((out[k].numpy().astype(np.float64) - arrays[k].numpy()) ** 2) for k in out))
    )
    if s.rollback_tuning_rounds:
        after = strategy.num_rounds + calibration_rounds(s.round, s.rollback_calibration_every)
        out = continue_training(phase, grid, out, rounds=s.rollback_tuning_rounds, after=after)
    report["rollback-tuning-rounds"] = s.rollback_tuning_rounds
    report["history-deleted-contributions"] = history.drop_users(forget)
    return out


def fresh_updates(phase, grid: Grid, theta: dict, users: np.ndarray, server_round: int) -> dict[int, UserDelta]:
    """FedEraser's fresh updates: ``users`` train once from ``theta`` (one train message per node, numbered
    ``server_round``); user -> its upload minus ``theta`` (float64).

    Raises:
        UnlearningFailed: a node failed or sent no usable reply.
    """
    strategy = phase.strategy
    record = ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in theta.items()})
    sent = strategy._topology().group(users)
    messages = strategy._messages(server_round, record, ConfigRecord(), sent, MessageType.TRAIN)
    phase.messages += len(messages)
    phase.bytes_sent += sum(payload_bytes(m.content) for m in messages)
    replies = list(grid.send_and_receive(messages, timeout=phase.timeout))
    phase.bytes_received += sum(payload_bytes(m.content) for m in replies if not m.has_error())
    current = decode_record(record, copy=False)
    out: dict[int, UserDelta] = {}
    for reply in replies:
        node = int(reply.metadata.src_node_id)
        if reply.has_error():
            raise UnlearningFailed(f"calibration round {server_round}: node {node} failed: {reply.error.reason}")
        try:
            uploads = user_uploads(reply.content, node, sent[node])
        except (KeyError, ValueError) as err:
            raise UnlearningFailed(f"calibration round {server_round}: node {node}'s reply: {err}") from None
        for user, (values, weight) in uploads.items():
            rows, items, dense = delta_from_reply(values, current, phase.layout, 1)
            out[int(user)] = UserDelta(rows=rows, items=items, dense=dense, weight=weight)
    return out
