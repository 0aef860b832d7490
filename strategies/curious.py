"""An honest-but-curious server: item-embedding FedAvg that also runs label-leakage attacks on every upload.

It aggregates exactly as :class:`fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg` (the model is unchanged), and before
aggregating a round it attacks each single-user reply's attribute-adversary update (FedAU², :mod:`fedrec_flwr.
adversary`) with iDLG on every reply and DLG on up to :attr:`LabelLeakageAudit.dlg_per_round` (10) replies of every
``eval-every``-th round (:mod:`fedrec_flwr.attacks.label_leakage`). The recovered labels are written, per round, node
and user, to ``label-leakage.csv`` in the run's results folder; the experiment scores them against the true
attributes, which the server never has. A reply is attacked when it carries one user's update (``num-users`` = 1):
always with ``users-per-node = 1``, and with more users per node in a round where only one of the node's users was
sampled (that reply is one user's, so mixing does not protect it: FedMF, age, 100 users per node, seed 2: 3 such
replies in 100 rounds, all 3 labels recovered). Replies that mix several users are not attacked (use
``users-per-node = 1`` to audit every user). With ``secure-aggregation = "secagg+"`` no reply carries a node's
``h_w`` gradient (only SecAgg+'s masked vectors, whose sum is all the server learns; :mod:`fedrec_flwr.adversary.secure`),
so iDLG and DLG attack the round's summed gradient instead and their one guess is recorded for every user the round
trained (``from-sum`` = 1; :meth:`LabelLeakageAudit.observe_secure_sum`).

``label-leakage.csv`` columns: ``round``; ``node`` (Flower node id); ``user`` (the user's index in the split, i.e. its
partition id with one user per node; -1 if unknown); ``idlg-label`` and ``dlg-label``: the guessed class, an index into
``fedrec_flwr.attributes.encode_attribute(split.attributes, protected_attribute).classes`` (``dlg-label`` is -1 where
DLG was not run); ``idlg-linked-label``: iDLG on the mean of *every* single-user ``h_w`` upload the server has had from
that node so far (this round's train reply, earlier rounds' train replies and, with ``adversary-server-steps`` > 1,
every ``adversary_gradient`` query reply; -1 where the node's uploads are not all one user's). Score it with
``labels[user] == idlg-label``; compare with the majority-class rate, not only 1/C. ``from-sum``: 1 where the guess
came from the SecAgg+ sum (every user of the round gets it), 0 from one reply.

The linked attack is ours. A server knows which node sent what, so it can average a node's
uploads; with ``dsvae-noise-stream = "per-upload"`` DSVAE's label-masking noise is drawn afresh for each upload, and
the label's term ``-onehot(a)`` of the head's
bias gradient is the same in all of them, so averaging ``k`` uploads divides the noise's std by ``sqrt(k)``. For two
classes the bias gradient ``p - onehot(a)`` separates the classes by ``2 (1 - p_a)``, so iDLG on the mean is right with
probability about ``Phi(sqrt(2 k) (1 - p_a) / noise)``: with an uninformed ``h_w`` (``p`` the gender prior 0.29 /
0.71) and noise std 1, about 0.71 for one upload (measured on ML-100K: 0.69-0.70) and 0.98 for the 20 uploads a round
of ``adversary-server-steps = 20`` brings. The per-upload rates (``idlg-label``) are what FedAU² reports; this column
is what a curious server can read. With the default ``"per-user"`` stream every upload of a user carries the same
draw, so the mean keeps the noise of one (measured: 0.735 linked against 0.729 per upload, FedMF, 100 rounds).
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from fedrec_flwr.adversary import ADVERSARY_MODULE, build_adversary
from fedrec_flwr.attacks.label_leakage import dlg_label, idlg_label
from fedrec_flwr.config import RunConfig
from fedrec_flwr.io import atomic_write_text
from fedrec_flwr.wire import ARRAYS, METRICS

from .item_fedavg import ItemEmbeddingFedAvg

log = logging.getLogger(__name__)

LEAKAGE_FILE = "label-leakage.csv"
LEAKAGE_COLUMNS = ("round", "node", "user", "idlg-label", "dlg-label", "idlg-linked-label", "from-sum")


class LabelLeakageAudit:
    """Strategy mixin: attack each single-user reply's adversary update before aggregating (module docstring).

    Attributes:
        dlg_per_round: DLG runs per audited round (DLG costs about 0.4 s per class per reply on one CPU core; iDLG
            is free).
        dlg_iterations: Adam steps of each DLG run.
        leakage_records: one dict per attacked reply (also written to ``label-leakage.csv``).
    """

    dlg_per_round = 10
    dlg_iterations = 100

    def setup_audit(self, config: RunConfig) -> None:
        """Remember the config; say at start when the audit will find nothing to attack."""
        if config.adversary == "none":
            log.warning("curious server: adversary = 'none', so there is no adversary update to attack")
        elif config.secure_aggregation != "off":
            log.info("curious server: secure aggregation is on, so it attacks each round's sum (one guess per round)")
        elif config.users_per_node > 1:
            log.warning(
                "curious server: users-per-node = %d, so only a reply of a node that trained exactly one user "
                "in the round is attacked (a reply mixing several users is not); set users-per-node = 1 to "
                "audit every user",
                config.users_per_node,
            )
        self._audit_config = config
        self._audit_folder: Path | None = None
        self._adversary = None
        self.leakage_records: list[dict] = []
        self._linked: dict[int, list] = {}  # node -> [sum of its single-user head-bias uploads, count, all single-user]

    def attach_results(self, folder: Path) -> None:
        """Called by the ServerApp with the run's results folder."""
        self._audit_folder = Path(folder)
        parent = getattr(super(), "attach_results", None)
        if parent is not None:
            parent(folder)

    def checkpoint_state(self) -> tuple[dict, dict]:
        """The strategy's checkpoint state plus the label-leakage records so far, so a resumed run's
        ``label-leakage.csv`` keeps the rounds before the checkpoint."""
        state, arrays = super().checkpoint_state()
        linked = {str(node): [total.tolist(), count, single] for node, (total, count, single) in self._linked.items()}
        return {
            **state,
            "label-leakage": [dict(r) for r in self.leakage_records],
            "label-leakage-linked": linked,
        }, arrays

    def restore_checkpoint_state(self, state, arrays, shared) -> None:
        """Inverse of :meth:`checkpoint_state`; rewrites ``label-leakage.csv`` with the restored records (a crash after
        the checkpoint may have left later rounds' records in it, which the resumed run attacks again)."""
        super().restore_checkpoint_state(state, arrays, shared)
        self.leakage_records = [dict(r) for r in state.get("label-leakage", [])]
        self._linked = {
            int(node): [np.asarray(total, dtype=np.float64), int(count), bool(single)]
            for node, (total, count, single) in state.get("label-leakage-linked", {}).items()
        }
        if "label-leakage" not in state:
            log.warning(
                "curious server: the checkpoint holds no label-leakage records (written by an older version); "
                "%s restarts with the resumed rounds only",
                LEAKAGE_FILE,
            )
        self._write_records()

    def _adversary_template(self, sent: ArrayRecord):
        if self._adversary is None:
            cfg = self._audit_config
            shapes = self.layout.shared_shapes
            first = next(k for k in shapes if k.startswith(ADVERSARY_MODULE + ".") and k.endswith(".weight"))
            self._adversary = build_adversary(  # in_dim: the input width of h_w's first layer (hidden or linear)
                cfg.adversary,
                shapes[first][1],
                shapes[f"{ADVERSARY_MODULE}.head.bias"][0],
                hidden=cfg.adversary_hidden,
                latent=cfg.dsvae_latent_dim,
                gradient_noise=0.0,
                generator=torch.Generator().manual_seed(0),
            )
        prefix = ADVERSARY_MODULE + "."
        with torch.no_grad():
            for name, param in self._adversary.named_parameters():
                param.copy_(torch.as_tensor(sent[prefix + name].numpy()))
        return self._adversary

    def _link(self, node: int, bias_gradient: np.ndarray | None) -> int:
        """Add one upload of ``node`` to its running sum (``None``: a reply that mixes users, which marks the node as
        not linkable); returns iDLG's guess on the node's mean upload, or -1."""
        entry = self._linked.setdefault(node, [None, 0, True])
        if bias_gradient is None:
            entry[2] = False
        else:
            entry[0] = np.asarray(bias_gradient, dtype=np.float64) + (0.0 if entry[0] is None else entry[0])
            entry[1] += 1
        return idlg_label(entry[0] / entry[1]) if entry[2] and entry[1] else -1

    def observe_adversary_replies(self, server_round: int, replies: list[tuple[int, ArrayRecord, int]]) -> None:
        """Called by :meth:`fedrec_flwr.strategies.adversary.AdversaryServerStep.extra_steps` with each accepted
        ``adversary_gradient`` reply as ``(node, arrays, users answered)``: the linked attack's further uploads."""
        bias_key = f"{ADVERSARY_MODULE}.head.bias"
        for node, arrays, users in replies:
            if bias_key in arrays:
                self._link(int(node), arrays[bias_key].numpy() if users == 1 else None)

    def audit(self, server_round: int, replies: list[Message]) -> None:
        """Attack every single-user reply (see the class docstring)."""
        sent = self._current
        bias_key = f"{ADVERSARY_MODULE}.head.bias"
        if sent is None or bias_key not in sent:
            return
        if self._audit_config.secure_aggregation != "off":  # replies carry zeros under h_w's keys: nothing to attack
            return
        run_dlg = server_round % self.eval_every == 0 or server_round == self.num_rounds
        dlg_done = 0
        prefix = ADVERSARY_MODULE + "."
        for message in replies:
            if message.has_error() or ARRAYS not in message.content.array_records:
                continue
            arrays = message.content[ARRAYS]
            if bias_key not in arrays:
                continue
            node = int(message.metadata.src_node_id)
            if float(message.content[METRICS].get("num-users", 0)) != 1:
                self._link(node, None)
                continue
            trained = self._sampled_nodes.get(node, [])
            user = int(trained[0]) if len(trained) == 1 else -1
            if self._audit_config.adversary_training == "server":  # the reply carries h_w's gradient itself
                update = {k[len(prefix) :]: arrays[k].numpy() for k in arrays.keys() if k.startswith(prefix)}
            else:  # updated values: the update w_sent - w_returned has the accumulated gradient's sign pattern
                update = {
                    k[len(prefix) :]: sent[k].numpy() - arrays[k].numpy() for k in arrays.keys() if k.startswith(prefix)
                }
            if not all(np.isfinite(v).all() for v in update.values()):
                continue
            record = {
                "round": server_round,
                "node": node,
                "user": user,
                "idlg-label": idlg_label(update["head.bias"]),
                "dlg-label": -1,
                "idlg-linked-label": self._link(node, update["head.bias"]),
                "from-sum": 0,
            }
            if run_dlg and dlg_done < self.dlg_per_round:
                record["dlg-label"] = dlg_label(
                    self._adversary_template(sent),
                    update,
                    iterations=self.dlg_iterations,
                    seed=server_round * 100003 + node % 100003,
                )
                dlg_done += 1
            self.leakage_records.append(record)
        self._write_records()

    def observe_secure_sum(self, server_round: int, sent: ArrayRecord, total: dict[str, np.ndarray]) -> None:
        """Called by :class:`fedrec_flwr.strategies.adversary.AdversaryServerStep` with the train step's SecAgg+ sum
        (``total``: ``h_w``'s summed gradients and ``"adversary-weight"``), all a server under
        ``secure-aggregation = "secagg+"`` learns of the uploads. The attacks run on the round's mean gradient (iDLG
        every round, DLG in evaluated rounds) and their guess is recorded for every user the round trained
        (``from-sum`` = 1): the best per-user guess a server holding only the sum can make, scored like the
        per-reply guesses."""
        prefix = ADVERSARY_MODULE + "."
        weight = float(np.asarray(total.get("adversary-weight", [0.0]))[0])
        if weight <= 0 or prefix + "head.bias" not in total:
            return
        update = {k[len(prefix) :]: np.asarray(v) / weight for k, v in total.items() if k.startswith(prefix)}
        if not all(np.isfinite(v).all() for v in update.values()):
            return
        guess = idlg_label(update["head.bias"])
        dlg = -1
        if server_round % self.eval_every == 0 or server_round == self.num_rounds:
            dlg = dlg_label(self._adversary_template(sent), update, iterations=self.dlg_iterations, seed=server_round)
        for node, users in sorted(self._sampled_nodes.items()):
            for user in users:
                self.leakage_records.append(
                    {
                        "round": server_round,
                        "node": int(node),
                        "user": int(user),
                        "idlg-label": guess,
                        "dlg-label": dlg,
                        "idlg-linked-label": -1,
                        "from-sum": 1,
                    }
                )
        self._write_records()

    def _write_records(self) -> None:
        if self._audit_folder is None:
            return
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=LEAKAGE_COLUMNS, lineterminator="\n", restval=-1)  # -1: not run
        writer.writeheader()
        writer.writerows(self.leakage_records)
        atomic_write_text(self._audit_folder / LEAKAGE_FILE, buffer.getvalue())


class CuriousItemFedAvg(LabelLeakageAudit, ItemEmbeddingFedAvg):
    """:class:`~fedrec_flwr.strategies.item_fedavg.ItemEmbeddingFedAvg` run by an honest-but-curious server (module docstring)."""

    @classmethod
    def from_run_config(cls, config: RunConfig, layout, topology=None):
        strategy = super().from_run_config(config, layout, topology)
        strategy.setup_audit(config)
        return strategy

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.audit(server_round, replies)
        return super().aggregate_train(server_round, replies)
