"""Mutation check, run by hand: apply single-line mutations to a temporary copy of the package and run the fast tests
that should notice each one. A mutant that leaves its tests green "survives": either the tests miss a behaviour that
matters (add a test), or the change is invisible by design (explain it).

Usage (from the project root; the whole table takes well over an hour on 2 cores, so run a part of it):

    OMP_NUM_THREADS=1 FEDREC_SHARED_DATA=../shared/data .venv/bin/python scripts/mutation_check.py \
        [--only ID ...] [--path SOURCE ...]
    .venv/bin/python scripts/mutation_check.py --check   # seconds: does every mutation still apply?

``--check`` runs no test: it verifies that every mutation's text still occurs in today's source exactly as often as
stated, that the mutated file still compiles, that every test it names exists, and that each source file of
:data:`COVERAGE` has its minimum number of mutations (``tests/test_mutation_check.py`` runs it in CI, so the table
stays true as the code changes).

The working tree is never modified: the code (``fedrec_flwr``, ``strategies``, ``clients``, ``experiments/*.py``,
``tests``) is copied to a temporary folder, which is put first on ``PYTHONPATH`` (checked: the tests import the
copy, not the editable install). Each mutation names the text it replaces, which must occur in the file exactly as
often as stated, so a mutation that no longer applies fails loudly instead of testing nothing. The unmutated copy's
tests run first and must pass. No Ray test is used (they take fixed ports and minutes).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SAM_TESTS = ("tests/test_sam.py", "tests/test_method_clients.py")
METRIC_TESTS = ("tests/test_metrics.py", "tests/test_baselines.py")
WIRE_TESTS = ("tests/test_wire_contribution.py", "tests/test_item_fedavg_strategy.py")
STRATEGY_TESTS = (
    "tests/test_item_fedavg_strategy.py",
    "tests/test_strategy_plugin.py",
    "tests/test_server_optimizer_strategy.py",
    "tests/test_simulation_properties.py",
)
KRYLOV_TESTS = ("tests/test_krylov_closed_form.py", "tests/test_krylov.py", "tests/test_hfkcu_trust_region.py")
GN_TESTS = ("tests/test_influence_curvature.py", "tests/test_hfkcu_trust_region.py")
INFLUENCE_TESTS = (
    "tests/test_influence_curvature.py",
    "tests/test_unlearning.py::test_influence_objective_is_the_users_training_loss",
    "tests/test_unlearning.py::test_batched_node_objective_equals_the_sum_of_the_users_objectives",
)
UNLEARNING_TESTS = (
    "tests/test_unlearning_steps.py",
    "tests/test_unlearning.py::test_forget_set_is_seeded_and_the_union_of_ids_and_fraction",
)
LOCAL_SOLVE_TESTS = ("tests/test_local_solve_negative_curvature.py",)
MARGIN_TESTS = ("tests/test_margin_root.py", "tests/test_hfkcu_margin.py")
ADVERSARY_TESTS = ("tests/test_dsvae_reparam.py", "tests/test_attack_streams.py", "tests/test_adversary.py")
ADVERSARY_STEP_TESTS = ("tests/test_adversary_server_step.py",)
ADAPTIVE_TESTS = ("tests/test_adaptive_epsilon.py",)
SPLIT_TESTS = ("tests/test_split_streams.py", "tests/test_data_errors.py", "tests/test_generic_loader.py")
ATTACK_TESTS = (
    "tests/test_membership_auc.py",
    "tests/test_attack_streams.py",
    "tests/test_bad_input_attacks.py",
    "tests/test_attacks.py::test_idlg_recovers_the_label_of_every_plain_adversary_update",
    "tests/test_attacks.py::test_dlg_recovers_the_label_of_a_plain_adversary_update_multiclass",
    "tests/test_attacks.py::test_dlg_recovers_the_label_of_a_plain_binary_adversary_update",
    "tests/test_attacks.py::test_membership_auc_is_chance_for_random_scores_and_exact_for_separated_ones",
    "tests/test_attacks.py::test_nonmember_items_never_holds_an_interacted_item",
    "tests/test_attacks.py::test_attribute_inference_on_random_labels_is_at_chance",
    "tests/test_attacks.py::test_attribute_inference_scored_against_swapped_classes_gives_one_minus_auc",
    "tests/test_attacks.py::test_attribute_inference_on_embeddings_that_encode_the_attribute_is_near_perfect",
)
CHECKPOINT_TESTS = (
    "tests/test_checkpoint_checks.py",
    "tests/test_checkpoint_resume.py::test_a_checkpoint_keeps_the_order_of_each_metrics_rows_keys",
    "tests/test_checkpoint_resume.py::test_resume_refuses_a_different_config_a_missing_and_a_damaged_checkpoint",
    "tests/test_checkpoint_resume.py::test_the_client_state_check_counts_absent_files_only_for_users_the_server_saw_train",
    "tests/test_checkpoint_resume.py::test_a_run_killed_mid_round_resumes_to_the_same_result",
)
CLIENT_STATE_TESTS = ("tests/test_checkpoint_checks.py", "tests/test_client_state.py")
SERVER_OPTIMIZER_TESTS = ("tests/test_server_optimizer_strategy.py",)
PFEDREC_TESTS = (
    "tests/test_pfedrec_item_step.py",
    "tests/test_method_clients.py::test_pfedrec_evaluates_with_its_personalised_rows",
)

COVERAGE = {
    "fedrec_flwr/unlearning/krylov.py": 5,
    "fedrec_flwr/unlearning/influence.py": 5,
    "strategies/unlearning*.py": 5,
    "fedrec_flwr/unlearning/margin.py": 5,
    "fedrec_flwr/adversary/": 5,
    "strategies/adversary.py": 5,
    "fedrec_flwr/data/split.py": 5,
    "fedrec_flwr/attacks/": 5,
    "fedrec_flwr/state/checkpoint.py": 5,
    "fedrec_flwr/state/client_state.py": 5,
    "strategies/server_optimizer.py": 5,
    "clients/pfedrec.py": 5,
}
"""Source file (or folder, ending in ``/``, or glob pattern) -> the fewest mutations :func:`check` requires there."""


@dataclass(frozen=True)
class Mutation:
    """``replacements``: ``(old, new, count)``: ``old`` must occur exactly ``count`` times in ``path``."""

    id: str
    path: str
    replacements: tuple[tuple[str, str, int], ...]
    tests: tuple[str, ...]
    note: str = ""


def one(old: str, new: str, count: int = 1) -> tuple[str, str, int]:
    return (old, new, count)


MUTATIONS: tuple[Mutation, ...] = (
    # ---- the decoupled SAM radii, the example-weighted evaluation mean and the parameter restore
    Mutation(
        "sam-swap-radii",
        "fedrec_flwr/local/sam.py",
        (
            one(
                "groups = ((shared_keys, self.rho_shared), (private_keys, self.rho_private))",
                "groups = ((shared_keys, self.rho_private), (private_keys, self.rho_shared))",
            ),
        ),
        SAM_TESTS,
        "the shared and private SAM radii swapped",
    ),
    Mutation(
        "sam-joint-perturbation",
        "fedrec_flwr/local/sam.py",
        (
            one(
                "groups = ((shared_keys, self.rho_shared), (private_keys, self.rho_private))",
                "groups = ((shared_keys + private_keys, self.rho_shared),)",
            ),
        ),
        SAM_TESTS,
        "plain SAM: one perturbation of both groups",
    ),
    Mutation(
        "evaluate-unweighted-mean",
        "strategies/evaluation.py",
        (
            one(
                "metrics = aggregate_metricrecords(ok, NUM_EXAMPLES)",
                "metrics = aggregate_metricrecords([RecordDict({METRICS: MetricRecord({**dict(r[METRICS]), "
                "NUM_EXAMPLES: 1.0})}) for r in ok], NUM_EXAMPLES)",
            ),
        ),
        STRATEGY_TESTS,
        "evaluation metrics averaged without the example weights",
    ),
    Mutation(
        "sam-no-restore-calls",
        "fedrec_flwr/local/sam.py",
        (one("self._restore(snapshot, ", "raise FloatingPointError(", 3),),
        SAM_TESTS,
        "a non-finite SAM step raises instead of restoring the parameters",
    ),
    Mutation(
        "restore-copies-nothing",
        "fedrec_flwr/local/training.py",
        (one("p.copy_(buf)", "pass"),),
        SAM_TESTS,
        "the restore copies nothing back",
    ),
    Mutation(
        "blocks-sam-swap-radii",
        "fedrec_flwr/local/blocks.py",
        (
            one(
                "groups = ((shared_keys, cfg.rho_shared), (block.private_keys, cfg.rho_private))",
                "groups = ((shared_keys, cfg.rho_private), (block.private_keys, cfg.rho_shared))",
            ),
        ),
        ("tests/test_blocks.py",),
        "the SAM radii swapped in the vectorized user blocks (checked against SAMTrainer)",
    ),
    # ---- sam.py
    Mutation(
        "sam-perturbation-not-normalised",
        "fedrec_flwr/local/sam.py",
        (
            one(
                "torch.full_like(norm, rho) / torch.where(ok, norm, 1.0)",
                "torch.full_like(norm, rho)",
            ),
        ),
        SAM_TESTS,
    ),
    Mutation(
        "sam-squared-norm",
        "fedrec_flwr/local/sam.py",
        (
            one(
                "torch.sqrt(sum((t.double() ** 2).flatten(1).sum(1) for t in tensors))",
                "sum((t.double() ** 2).flatten(1).sum(1) for t in tensors)",
            ),
        ),
        SAM_TESTS,
    ),
    Mutation(
        "sam-gradient-keeps-the-perturbation", "fedrec_flwr/local/sam.py", (one("p.copy_(s)", "pass"),), SAM_TESTS
    ),
    Mutation("sam-shared-grads-sum-over-steps", "fedrec_flwr/local/sam.py", (one("s / epochs", "s"),), SAM_TESTS),
    Mutation(
        "sam-loss-not-divided-by-chunks",
        "fedrec_flwr/local/sam.py",
        (one("return value / chunks, n", "return value, n"),),
        SAM_TESTS,
    ),
    Mutation(
        "sam-private-step-skipped",
        "fedrec_flwr/local/sam.py",
        (one("        self.optimizer.step()\n", "        pass\n"),),
        SAM_TESTS,
    ),
    # ---- metrics.py
    Mutation(
        "rank-ties-for-the-model",
        "fedrec_flwr/metrics.py",
        (one("(values >= values[int(target_index)]).sum()", "(values > values[int(target_index)]).sum()"),),
        METRIC_TESTS,
    ),
    Mutation(
        "batch-rank-ties-for-the-model",
        "fedrec_flwr/metrics.py",
        (one("(values >= target_scores)", "(values > target_scores)"),),
        METRIC_TESTS,
    ),
    Mutation(
        "ndcg-off-by-one", "fedrec_flwr/metrics.py", (one("math.log2(rank + 2)", "math.log2(rank + 3)"),), METRIC_TESTS
    ),
    Mutation(
        "batch-ndcg-off-by-one",
        "fedrec_flwr/metrics.py",
        (one("np.log2(ranks + 2.0)", "np.log2(ranks + 3.0)"),),
        METRIC_TESTS,
    ),
    Mutation(
        "hit-inclusive",
        "fedrec_flwr/metrics.py",
        (one("1.0 if rank < k else 0.0", "1.0 if rank <= k else 0.0"),),
        METRIC_TESTS,
    ),
    Mutation(
        "batch-hit-inclusive", "fedrec_flwr/metrics.py", (one("hit = ranks < k", "hit = ranks <= k"),), METRIC_TESTS
    ),
    Mutation(
        "k-zero-accepted",
        "fedrec_flwr/metrics.py",
        (one("or k < 1 for k in ks", "or k < 0 for k in ks"),),
        METRIC_TESTS,
    ),
    Mutation(
        "nan-scores-accepted",
        "fedrec_flwr/metrics.py",
        (one("if np.isnan(values).any():", "if False:", 2),),
        METRIC_TESTS,
    ),
    Mutation(
        "mean-is-median",
        "fedrec_flwr/metrics.py",
        (one("float(np.mean(values))", "float(np.median(values))"),),
        METRIC_TESTS,
    ),
    # ---- wire.py
    Mutation(
        "contribution-dense-unweighted",
        "fedrec_flwr/wire.py",
        (
            one(
                "value = np.asarray(dense[key], dtype=np.float64) * num_examples",
                "value = np.asarray(dense[key], dtype=np.float64)",
            ),
        ),
        WIRE_TESTS,
    ),
    Mutation(
        "contribution-row-count-not-summed",
        "fedrec_flwr/wire.py",
        (one("counts[where] += 1.0", "counts[where] = 1.0"),),
        WIRE_TESTS,
    ),
    Mutation(
        "contribution-row-sum-not-summed",
        "fedrec_flwr/wire.py",
        (one("sums[where] += values", "sums[where] = values"),),
        WIRE_TESTS,
    ),
    Mutation(
        "merge-touched-divides-by-all",
        "fedrec_flwr/wire.py",
        (one("(total[touched] / count[touched].reshape(shape))", "(total[touched] / count.sum())"),),
        WIRE_TESTS,
    ),
    Mutation(
        "merge-selected-ignores-count",
        "fedrec_flwr/wire.py",
        (
            one(
                "(total[touched] - count[touched].reshape(shape) * base) / num_users",
                "(total[touched] - base) / num_users",
            ),
        ),
        WIRE_TESTS + ("tests/test_method_clients.py",),
    ),
    Mutation(
        "sampling-ignores-the-round",
        "fedrec_flwr/wire.py",
        (
            one(
                "np.random.default_rng([seed, 0x5A3B, tag, server_round])", "np.random.default_rng([seed, 0x5A3B, tag])"
            ),
        ),
        WIRE_TESTS,
    ),
    Mutation(
        "private-key-with-suffix-accepted",
        "fedrec_flwr/wire.py",
        (
            one(
                'if key.split("#", 1)[0] in private:\n            raise PrivacyViolation(f"a client reply carries',
                'if key in private:\n            raise PrivacyViolation(f"a client reply carries',
            ),
        ),
        WIRE_TESTS,
    ),
    Mutation(
        "zero-row-count-accepted", "fedrec_flwr/wire.py", (one("counts.min() <= 0", "counts.min() < 0"),), WIRE_TESTS
    ),
    # ---- item-embedding FedAvg: aggregation, reply checks, round sizes, evaluation
    Mutation(
        "dense-average-unweighted",
        "strategies/aggregation.py",
        (
            one(
                "RecordDict({ARRAYS: ArrayRecord({k: r[ARRAYS][k] for k in dense_keys}), METRICS: r[METRICS]})",
                "RecordDict({ARRAYS: ArrayRecord({k: r[ARRAYS][k] for k in dense_keys}), "
                "METRICS: MetricRecord({NUM_EXAMPLES: 1.0})})",
            ),
        ),
        STRATEGY_TESTS,
    ),
    Mutation(
        "zero-weight-reply-accepted",
        "strategies/replies.py",
        (one("or weight <= 0:", "or weight < 0:"),),
        STRATEGY_TESTS,
    ),
    Mutation(
        "replied-users-counts-replies",
        "strategies/aggregation.py",
        (one('float(sum(float(r[METRICS].get("num-users", 0)) for r in accepted))', "float(len(accepted))"),),
        STRATEGY_TESTS + ("tests/test_method_clients.py",),
    ),
    Mutation(
        "min-train-fraction-floor",
        "strategies/train_round.py",
        (one("math.ceil(min_train_fraction * expected)", "math.floor(min_train_fraction * expected)"),),
        STRATEGY_TESTS,
    ),
    Mutation(
        "eval-users-counts-replies",
        "strategies/evaluation.py",
        (one("float(sum(float(r[METRICS][NUM_EXAMPLES]) for r in ok))", "float(len(ok))"),),
        STRATEGY_TESTS,
    ),
    # ---- krylov.py
    Mutation(
        "steihaug-boundary-measures-the-step",
        "fedrec_flwr/unlearning/krylov.py",
        (one("if _m_norm(x + alpha * p, m) >= radius:", "if _m_norm(alpha * p, m) >= radius:"),),
        KRYLOV_TESTS,
    ),
    Mutation(
        "krylov-damping-dropped",
        "fedrec_flwr/unlearning/krylov.py",
        (one("return ap + damping * p", "return ap"),),
        KRYLOV_TESTS,
    ),
    Mutation(
        "to-boundary-negative-root",
        "fedrec_flwr/unlearning/krylov.py",
        (
            one(
                "return (-half_b + math.sqrt(disc)) / a if a > 0 else 0.0",
                "return (-half_b - math.sqrt(disc)) / a if a > 0 else 0.0",
            ),
        ),
        KRYLOV_TESTS,
    ),
    Mutation(
        "cg-beta-inverted",
        "fedrec_flwr/unlearning/krylov.py",
        (one("p = r + (rs_new / rs) * p", "p = r + (rs / rs_new) * p"),),
        KRYLOV_TESTS,
    ),
    Mutation(
        "steihaug-residual-not-preconditioned",
        "fedrec_flwr/unlearning/krylov.py",
        (one("y = r if m is None else r / m  # the preconditioned", "y = r  # the preconditioned"),),
        KRYLOV_TESTS
        + ("tests/test_hfkcu_preconditioner.py::test_diagonal_preconditioner_solves_a_diagonal_system_in_one_product",),
    ),
    Mutation(
        "gauss-newton-drops-output-curvature",
        "fedrec_flwr/unlearning/curvature.py",
        (one("(product,) = pullback(hjv.detach())", "(product,) = pullback(jv.detach())"),),
        GN_TESTS,
    ),
    Mutation(
        "gn-diagonal-not-squared",
        "fedrec_flwr/unlearning/curvature.py",
        (
            one(
                "out[key].index_add_(0, rows, value.detach() ** 2)",
                "out[key].index_add_(0, rows, value.detach().abs())",
            ),
        ),
        GN_TESTS,
    ),
    # ---- influence.py
    Mutation(
        "bce-curvature-unweighted",
        "fedrec_flwr/unlearning/influence.py",
        (one("                return weight_t * s * (1.0 - s)", "                return s * (1.0 - s)"),),
        INFLUENCE_TESTS,
    ),
    Mutation(
        "bpr-curvature-unweighted",
        "fedrec_flwr/unlearning/influence.py",
        (one("c = weight_t * s * (1.0 - s)", "c = s * (1.0 - s)"),),
        INFLUENCE_TESTS,
    ),
    Mutation(
        "influence-loss-is-a-sum-not-a-mean",
        "fedrec_flwr/unlearning/influence.py",
        (one("weights.append(np.full(count, 1.0 / count))", "weights.append(np.full(count, 1.0))"),),
        INFLUENCE_TESTS,
    ),
    Mutation(
        "bce-influence-loss-unweighted",
        "fedrec_flwr/unlearning/influence.py",
        (
            one(
                'return (weight_t * F.binary_cross_entropy_with_logits(logits, label_t, reduction="none")).sum()',
                'return F.binary_cross_entropy_with_logits(logits, label_t, reduction="none").sum()',
            ),
        ),
        INFLUENCE_TESTS,
    ),
    Mutation(
        "bpr-influence-loss-sign",
        "fedrec_flwr/unlearning/influence.py",
        (
            one(
                "-(weight_t * F.logsigmoid(scores[:n] - scores[n:])).sum()",
                "-(weight_t * F.logsigmoid(scores[n:] - scores[:n])).sum()",
            ),
        ),
        INFLUENCE_TESTS,
    ),
    Mutation(
        "node-dense-decay-counted-once",
        "fedrec_flwr/unlearning/influence.py",
        (
            one(
                "loss = loss + 0.5 * decay * len(clients) * value.pow(2).sum()",
                "loss = loss + 0.5 * decay * value.pow(2).sum()",
            ),
        ),
        INFLUENCE_TESTS,
    ),
    # ---- strategies/unlearning.py
    Mutation(
        "ascent-not-divided-by-forgotten-users",
        "strategies/unlearning_baselines.py",
        (
            one(
                "s.ascent_learning_rate * gradient[key] / max(len(s.forget), 1)",
                "s.ascent_learning_rate * gradient[key]",
            ),
        ),
        UNLEARNING_TESTS,
    ),
    Mutation(
        "ascent-gradient-not-recomputed",
        "strategies/unlearning_baselines.py",
        (one("gradient, _ = phase.gradient(grid, record, np.asarray(s.forget, dtype=np.int64))", "_ = record"),),
        UNLEARNING_TESTS,
    ),
    Mutation(
        "forget-draw-from-curvature-stream",
        "strategies/unlearning.py",
        (one("numpy_rng(config.seed, TAG_FORGET)", "numpy_rng(config.seed, TAG_CURVATURE_SAMPLE)"),),
        UNLEARNING_TESTS,
    ),
    Mutation(
        "preconditioner-not-normalised",
        "strategies/unlearning_krylov.py",
        (one("m = (flatten(diagonal, shapes) + floor) / (mean + floor)", "m = flatten(diagonal, shapes) + floor"),),
        UNLEARNING_TESTS,
    ),
    Mutation(
        "preconditioner-without-floor",
        "strategies/unlearning_krylov.py",
        (one("floor = PRECONDITIONER_FLOOR * mean\n", "floor = 0.0\n"),),
        UNLEARNING_TESTS,
    ),
    Mutation(
        "preconditioner-mean-over-every-entry",
        "strategies/unlearning_krylov.py",
        (
            one(
                "mean = sum(float(v.sum()) for v in touched.values()) / count if count else 0.0",
                "mean = sum(float(v.sum()) for v in diagonal.values()) / count if count else 0.0",
            ),
        ),
        UNLEARNING_TESTS,
    ),
    Mutation(
        "row-preconditioner-keeps-dense-entries",
        "strategies/unlearning_krylov.py",
        (one("else np.full_like(v, v.mean())", "else v.copy()"),),
        UNLEARNING_TESTS,
    ),
    Mutation(
        "local-solve-drops-boundary-steps",
        "fedrec_flwr/app/queries.py",
        (
            one(
                "if not result.boundary and (result.negative_curvature or result.residual > 1.0):",
                "if result.negative_curvature or result.residual > 1.0:",
            ),
        ),
        LOCAL_SOLVE_TESTS,
    ),
    # ---- unlearn_margin.py
    Mutation(
        "dominated-includes-ties",
        "fedrec_flwr/unlearning/margin.py",
        (
            one(
                "np.asarray(forgotten_counts) > np.asarray(remaining_counts)",
                "np.asarray(forgotten_counts) >= np.asarray(remaining_counts)",
            ),
        ),
        MARGIN_TESTS,
    ),
    Mutation(
        "margin-reference-includes-interacted",
        "fedrec_flwr/unlearning/margin.py",
        (one("free[np.asarray(interacted, np.int64)] = False", "pass"),),
        MARGIN_TESTS,
    ),
    Mutation(
        "margin-root-is-the-midpoint",
        "fedrec_flwr/unlearning/margin.py",
        (one("lo + (hi - lo) * f_lo / (f_lo - f_hi)", "0.5 * (lo + hi)"),),
        MARGIN_TESTS,
    ),
    Mutation(
        "margin-steps-on-zero-at-zero",
        "fedrec_flwr/unlearning/margin.py",
        (one("if tried[0.0] <= 0:", "if tried[0.0] < 0:"),),
        MARGIN_TESTS,
    ),
    Mutation(
        "popularity-bins-reversed",
        "fedrec_flwr/unlearning/margin.py",
        (
            one(
                "order = np.lexsort((np.arange(counts.size), counts))",
                "order = np.lexsort((np.arange(counts.size), -counts))",
            ),
        ),
        MARGIN_TESTS,
    ),
    Mutation(
        "positive-counts-not-summed",
        "fedrec_flwr/unlearning/margin.py",
        (one("np.add.at(counts, split.positives(int(user)), 1.0)", "counts[split.positives(int(user))] = 1.0"),),
        MARGIN_TESTS,
    ),
    # ---- adversary/
    Mutation(
        "dsvae-latent-scaled-by-variance",
        "fedrec_flwr/adversary/models.py",
        (one("z = mu + torch.exp(0.5 * logvar) * xi", "z = mu + torch.exp(logvar) * xi"),),
        ADVERSARY_TESTS,
    ),
    Mutation(
        "grl-does-not-reverse",
        "fedrec_flwr/adversary/grl.py",
        (one("return -strength * grad, None", "return strength * grad, None"),),
        ADVERSARY_TESTS,
    ),
    Mutation(
        "head-gradient-noise-dropped",
        "fedrec_flwr/adversary/grl.py",
        (one("return grad + noise, None", "return grad, None"),),
        ADVERSARY_TESTS,
    ),
    Mutation(
        "sut-ignores-the-prediction",
        "fedrec_flwr/adversary/term.py",
        (one("return float(epsilon) if correct else 0.0", "return float(epsilon)"),),
        ADVERSARY_TESTS,
    ),
    Mutation(
        "class-prior-not-normalised",
        "fedrec_flwr/adversary/prior.py",
        (one("return torch.log(prior / prior.sum())", "return torch.log(prior)"),),
        ADVERSARY_TESTS,
    ),
    Mutation(
        "dsvae-kl-sign-of-logvar",
        "fedrec_flwr/adversary/models.py",
        (one("0.5 * (mu.pow(2) + logvar.exp() - 1.0 - logvar)", "0.5 * (mu.pow(2) + logvar.exp() - 1.0 + logvar)"),),
        ADVERSARY_TESTS,
    ),
    Mutation(
        "adaptive-step-ignores-chance",
        "fedrec_flwr/adversary/adaptive.py",
        (one("violation = (signal - chance - delta) / chance", "violation = (signal - delta) / chance"),),
        ADAPTIVE_TESTS,
    ),
    Mutation(
        "adaptive-statistics-count-the-wrong",
        "fedrec_flwr/adversary/adaptive.py",
        (one("(logits.argmax(dim=-1) == labels).double(),", "(logits.argmax(dim=-1) != labels).double(),"),),
        ADAPTIVE_TESTS,
    ),
    Mutation(
        "adaptive-eps-not-projected",
        "fedrec_flwr/adversary/adaptive.py",
        (
            one(
                "return float(min(max(epsilon * math.exp(rate * violation), lower), upper))",
                "return float(epsilon * math.exp(rate * violation))",
            ),
        ),
        ADAPTIVE_TESTS,
    ),
    # ---- strategies/adversary.py
    Mutation(
        "server-step-keeps-its-own-values",
        "strategies/adversary.py",
        (
            one(
                "                param.copy_(torch.as_tensor(np.asarray(current[key]), dtype=torch.float32))",
                "                pass",
            ),
        ),
        ADVERSARY_STEP_TESTS,
    ),
    Mutation(
        "adversary-mean-unweighted",
        "strategies/adversary.py",
        (one("out[key] = np.tensordot(weights, stacked, axes=1) / weights.sum()", "out[key] = stacked.mean(axis=0)"),),
        ADVERSARY_STEP_TESTS,
    ),
    Mutation(
        "adversary-adam-is-sgd",
        "strategies/adversary.py",
        (
            one(
                'make = torch.optim.Adam if self.optimizer_name == "adam" else torch.optim.SGD',
                "make = torch.optim.SGD",
            ),
        ),
        ADVERSARY_STEP_TESTS,
    ),
    Mutation(
        "adversary-ascends",
        "strategies/adversary.py",
        (
            one(
                "param.grad = torch.as_tensor(np.asarray(mean_gradient[key]), dtype=torch.float32)",
                "param.grad = -torch.as_tensor(np.asarray(mean_gradient[key]), dtype=torch.float32)",
            ),
        ),
        ADVERSARY_STEP_TESTS,
    ),
    Mutation(
        "apply-returns-the-aggregate-unchanged",
        "strategies/adversary.py",
        (one("return ArrayRecord({k: Array(new[k]) if k in new else v for k, v in arrays.items()})", "return arrays"),),
        ADVERSARY_STEP_TESTS,
    ),
    Mutation(
        "adversary-zero-weight-reply-accepted",
        "strategies/adversary.py",
        (one("or weight <= 0:", "or weight < 0:"),),
        ADVERSARY_STEP_TESTS,
    ),
    # ---- data/split.py
    Mutation(
        "validation-negatives-from-the-test-stream",
        "fedrec_flwr/data/split.py",
        (one("num_test_negatives, seed, TAG_VAL_NEG)", "num_test_negatives, seed, TAG_TEST_NEG)"),),
        SPLIT_TESTS,
    ),
    Mutation(
        "test-negatives-from-the-validation-stream",
        "fedrec_flwr/data/split.py",
        (one("num_test_negatives, seed, TAG_TEST_NEG)", "num_test_negatives, seed, TAG_VAL_NEG)"),),
        SPLIT_TESTS,
    ),
    Mutation(
        "train-negatives-ignore-the-round",
        "fedrec_flwr/data/split.py",
        (
            one(
                "np.random.default_rng([int(seed), TAG_TRAIN_NEG, int(user), int(round)])",
                "np.random.default_rng([int(seed), TAG_TRAIN_NEG, int(user)])",
            ),
        ),
        SPLIT_TESTS,
    ),
    Mutation(
        "complement-items-left-side",
        "fedrec_flwr/data/split.py",
        (one('np.searchsorted(shifted, ranks, side="right")', 'np.searchsorted(shifted, ranks, side="left")'),),
        SPLIT_TESTS,
    ),
    Mutation(
        "validation-item-third-latest",
        "fedrec_flwr/data/split.py",
        (one("second = order[ends - 2]", "second = order[ends - 3]"),),
        SPLIT_TESTS,
    ),
    Mutation(
        "negatives-may-hit-the-last-interacted-item",
        "fedrec_flwr/data/split.py",
        (
            one(
                "interacted = all_items[all_indptr[u] : all_indptr[u + 1]]",
                "interacted = all_items[all_indptr[u] : all_indptr[u + 1] - 1]",
            ),
        ),
        SPLIT_TESTS,
    ),
    # ---- attacks/
    Mutation(
        "membership-auc-is-pooled",
        "fedrec_flwr/attacks/membership.py",
        (one('"auc": float(np.mean(per_user)),', '"auc": float(pooled),'),),
        ATTACK_TESTS,
    ),
    Mutation(
        "nonmembers-may-be-held-out-items",
        "fedrec_flwr/attacks/membership.py",
        (
            one(
                "np.setdiff1d(np.arange(split.num_items), split.interacted(user))",
                "np.setdiff1d(np.arange(split.num_items), split.positives(user))",
            ),
        ),
        ATTACK_TESTS,
    ),
    Mutation(
        "membership-auc-std-dropped",
        "fedrec_flwr/attacks/membership.py",
        (one('"auc-std": float(np.std(per_user))', '"auc-std": 0.0'),),
        ATTACK_TESTS,
    ),
    Mutation(
        "idlg-reads-the-largest-entry",
        "fedrec_flwr/attacks/label_leakage.py",
        (one("return int(np.argmin(delta))", "return int(np.argmax(delta))"),),
        ATTACK_TESTS,
    ),
    Mutation(
        "dlg-keeps-the-worst-match",
        "fedrec_flwr/attacks/label_leakage.py",
        (one("if final < best_distance:", "if final > best_distance:"),),
        ATTACK_TESTS,
    ),
    Mutation(
        "attribute-halves-reuse-one-stream",
        "fedrec_flwr/attacks/attribute_inference.py",
        (one("rng = np.random.default_rng([int(seed), split])", "rng = np.random.default_rng([int(seed)])"),),
        ATTACK_TESTS,
    ),
    # ---- checkpoint.py
    Mutation(
        "resume-ignores-keys-only-the-new-config-has",
        "fedrec_flwr/state/checkpoint.py",
        (
            one(
                'keys = (set(checkpoint.run_config) | set(run_config)) - set(MAY_DIFFER) - {"plugin-config"}',
                'keys = set(checkpoint.run_config) - set(MAY_DIFFER) - {"plugin-config"}',
            ),
        ),
        CHECKPOINT_TESTS,
    ),
    Mutation(
        "resume-past-the-last-round-accepted",
        "fedrec_flwr/state/checkpoint.py",
        (one('if checkpoint.server_round > int(run_config["num-server-rounds"]):', "if False:"),),
        CHECKPOINT_TESTS,
    ),
    Mutation(
        "removed-users-count-as-trained",
        "fedrec_flwr/state/checkpoint.py",
        (
            one(
                'trained[[int(u) for u in checkpoint.strategy_state.get("removed-users", []) if 0 <= int(u) < trained.size]] = (\n'
                "            False\n"
                "        )",
                "pass",
            ),
        ),
        CHECKPOINT_TESTS,
    ),
    Mutation(
        "strategy-arrays-saved-as-shared",
        "fedrec_flwr/state/checkpoint.py",
        (
            one(
                '(("arrays", checkpoint.arrays), ("strategy", checkpoint.strategy_arrays))',
                '(("arrays", checkpoint.arrays), ("arrays", checkpoint.strategy_arrays))',
            ),
        ),
        CHECKPOINT_TESTS,
    ),
    Mutation(
        "checkpoint-format-unchecked",
        "fedrec_flwr/state/checkpoint.py",
        (one('if manifest.get("format") != FORMAT:', "if False:"),),
        CHECKPOINT_TESTS,
    ),
    Mutation(
        "checkpoint-rows-in-sorted-order",
        "fedrec_flwr/state/checkpoint.py",
        (
            one(
                "return [{key: row[key] for key in order if key in row} | row for row, order in zip(rows, orders)]",
                "return rows",
            ),
        ),
        CHECKPOINT_TESTS,
    ),
    # ---- client_state.py
    Mutation(
        "state-keeps-only-the-newest-version",
        "fedrec_flwr/state/client_state.py",
        (
            one(
                "return {r for r in rounds if r > durable_round} | ({max(settled)} if settled else set())",
                "return {newest}",
            ),
        ),
        CLIENT_STATE_TESTS,
    ),
    Mutation(
        "state-load-excludes-its-round",
        "fedrec_flwr/state/client_state.py",
        (
            one(
                "eligible = [r for r in versions if as_of is None or r <= as_of]",
                "eligible = [r for r in versions if as_of is None or r < as_of]",
            ),
        ),
        CLIENT_STATE_TESTS,
    ),
    Mutation(
        "state-load-keeps-stale-records",
        "fedrec_flwr/state/client_state.py",
        (one("            del state[key]", "            pass"),),
        CLIENT_STATE_TESTS,
    ),
    Mutation(
        "state-file-of-another-user-accepted",
        "fedrec_flwr/state/client_state.py",
        (one('if int(manifest["user"]) != int(user):', "if False:"),),
        CLIENT_STATE_TESTS,
    ),
    Mutation(
        "resume-absent-excludes-its-round",
        "fedrec_flwr/state/client_state.py",
        (
            one(
                "resumed = max((r for r in versions if r <= resume_round), default=None)",
                "resumed = max((r for r in versions if r < resume_round), default=None)",
            ),
        ),
        CLIENT_STATE_TESTS,
    ),
    Mutation(
        "state-run-name-unchecked",
        "fedrec_flwr/state/client_state.py",
        (one("if not isinstance(run, str) or run_name_problem(run) is not None:", "if not isinstance(run, str):"),),
        CLIENT_STATE_TESTS,
    ),
    # ---- server_optimizer.py
    Mutation(
        "lazy-adam-in-selected-mode",
        "strategies/server_optimizer.py",
        (
            one(
                'lazy = self.item_aggregation == "touched" and self.server_optimizer == "adam"',
                'lazy = self.server_optimizer == "adam"',
            ),
        ),
        SERVER_OPTIMIZER_TESTS,
    ),
    Mutation(
        "adopt-arrays-ignored",
        "strategies/server_optimizer.py",
        (one("param.copy_(torch.as_tensor(arrays[key].numpy(), dtype=param.dtype))", "pass"),),
        SERVER_OPTIMIZER_TESTS
        + ("tests/test_unlearning.py::test_server_optimizer_strategy_continues_from_the_unlearned_model",),
    ),
    Mutation(
        "parameter-replies-accepted-as-gradients",
        "strategies/server_optimizer.py",
        (one('if metrics.get(GRADIENT_USERS, 0) != metrics.get("num-users", -1):', "if False:"),),
        SERVER_OPTIMIZER_TESTS,
    ),
    Mutation(
        "touched-mode-steps-every-row",
        "strategies/server_optimizer.py",
        (one("rows = np.flatnonzero(count > 0)", "rows = np.flatnonzero(count >= 0)"),),
        SERVER_OPTIMIZER_TESTS,
    ),
    Mutation(
        "gradient-upload-not-requested",
        "strategies/server_optimizer.py",
        (one('config[UPLOAD_KEY] = "gradient"', "pass"),),
        SERVER_OPTIMIZER_TESTS,
    ),
    Mutation(
        "server-optimizer-state-not-restored",
        "strategies/server_optimizer.py",
        (one('if not state.get("server-optimizer-started"):', "if True:"),),
        SERVER_OPTIMIZER_TESTS
        + ("tests/test_checkpoint_resume.py::test_a_run_killed_mid_round_resumes_to_the_same_result",),
    ),
    # ---- clients/pfedrec.py
    Mutation(
        "pfedrec-item-step-at-the-score-rate",
        "clients/pfedrec.py",
        (
            one(
                "torch.optim.SGD(self.model.shared_parameters(), lr=self.item_learning_rate)",
                "torch.optim.SGD(self.model.shared_parameters(), lr=self.cfg.learning_rate)",
            ),
        ),
        PFEDREC_TESTS,
    ),
    Mutation(
        "pfedrec-default-rate-lacks-num-items",
        "clients/pfedrec.py",
        (one("cfg.learning_rate * self.runtime.split.num_items * LR_ETA", "cfg.learning_rate * LR_ETA"),),
        PFEDREC_TESTS,
    ),
    Mutation(
        "pfedrec-item-step-skipped",
        "clients/pfedrec.py",
        (one("return self.optimizer_step(self._item_optimizer, users, items, labels)", "return value"),),
        PFEDREC_TESTS,
    ),
    Mutation(
        "pfedrec-score-step-skipped",
        "clients/pfedrec.py",
        (one("value = self.optimizer_step(self.optimizer, users, items, labels)", "value = 0.0"),),
        PFEDREC_TESTS,
    ),
    Mutation(
        "pfedrec-personal-rows-not-applied",
        "clients/pfedrec.py",
        (one('table[rows] = torch.as_tensor(record["values"].numpy(), device=table.device)', "pass"),),
        PFEDREC_TESTS,
    ),
    Mutation(
        "pfedrec-personal-rows-not-kept",
        "clients/pfedrec.py",
        (
            one(
                'self.state[self.rows_key] = ArrayRecord({"rows": Array(rows.copy()), "values": Array(values.copy())})',
                "pass",
            ),
        ),
        PFEDREC_TESTS,
    ),
)


def copy_tree(dest: Path) -> None:
    """The Python files of every top-level package (``fedrec_flwr``, ``strategies``, ``clients``, ``plugins``,
    ``experiments``: not their results), the whole ``tests`` folder and ``pyproject.toml``."""
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for package in sorted(p.parent for p in ROOT.glob("*/__init__.py")):
        for path in package.rglob("*.py"):
            if "__pycache__" not in path.parts:
                target = dest / path.relative_to(ROOT)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return 124, "timeout", time.perf_counter() - started
    lines = [
        line
        for line in done.stdout.splitlines()
        if line.startswith(("FAILED", "ERROR")) or " passed" in line or " failed" in line
    ]
    return done.returncode, "; ".join(lines[-3:]), time.perf_counter() - started


def apply(copy: Path, mutation: Mutation) -> str:
    path = copy / mutation.path
    original = path.read_text()
    text = original
    for old, new, count in mutation.replacements:
        found = text.count(old)
        if found != count:
            raise SystemExit(
                f"mutation {mutation.id}: {old!r} occurs {found} times in {mutation.path}, expected {count}"
            )
        text = text.replace(old, new)
    path.write_text(text)
    return original


def _covers(target: str, path: str) -> bool:
    """Whether the mutated file ``path`` counts for the :data:`COVERAGE` entry ``target``: a file, a folder (ending in
    ``/``) or a glob pattern (with ``*``, e.g. a module and the modules it is split into)."""
    if "*" in target:
        return fnmatch.fnmatchcase(path, target)
    return path.startswith(target) if target.endswith("/") else path == target


def check(root: Path = ROOT) -> list[str]:
    """Why the table is no longer true of the source under ``root`` (``[]``: it is): a mutation whose text does not
    occur as often as stated (applied in order, as :func:`apply` does), one that leaves the file unchanged or not
    compiling, a named test file or test function that does not exist, a duplicate id, or a :data:`COVERAGE` entry
    with too few mutations. Reads files only; runs nothing."""
    problems = []
    ids = [m.id for m in MUTATIONS]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        problems.append(f"duplicate mutation ids: {duplicates}")
    for mutation in MUTATIONS:
        path = root / mutation.path
        if not path.is_file():
            problems.append(f"{mutation.id}: {mutation.path} does not exist")
            continue
        original = text = path.read_text()
        for old, new, count in mutation.replacements:
            found = text.count(old)
            if found != count:
                problems.append(f"{mutation.id}: {old!r} occurs {found} times in {mutation.path}, expected {count}")
            text = text.replace(old, new)
        if text == original:
            problems.append(f"{mutation.id}: changes nothing in {mutation.path}")
        else:
            try:
                compile(text, mutation.path, "exec")
            except SyntaxError as err:
                problems.append(
                    f"{mutation.id}: the mutated {mutation.path} does not compile ({err.msg}, line {err.lineno})"
                )
        if not mutation.tests:
            problems.append(f"{mutation.id}: names no test")
        for test in mutation.tests:
            file, _, name = test.partition("::")
            if not (root / file).is_file():
                problems.append(f"{mutation.id}: test file {file} does not exist")
            elif name and not re.search(rf"^def {re.escape(name.split('[')[0])}\(", (root / file).read_text(), re.M):
                problems.append(f"{mutation.id}: {file} has no test function {name!r}")
    for target, minimum in COVERAGE.items():
        found = sum(1 for m in MUTATIONS if _covers(target, m.path))
        if found < minimum:
            problems.append(f"{target}: {found} mutations, at least {minimum} required")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutation ids to run (default: all)")
    parser.add_argument(
        "--path", nargs="*", help="run only the mutations of these source files or folders (a folder ends in '/')"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test run")
    parser.add_argument(
        "--check",
        action="store_true",
        help="run no test: check that every mutation still applies "
        "to the source and names existing tests (exit 1 if not)",
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for problem in problems:
            print(f"mutation table: {problem}", file=sys.stderr)
        if not problems:
            files = len({m.path for m in MUTATIONS})
            print(f"all {len(MUTATIONS)} mutations apply to the source ({files} files) and name existing tests")
        return 1 if problems else 0
    unknown = sorted(set(args.only or ()) - {m.id for m in MUTATIONS})
    if unknown:
        print(f"mutation_check: unknown mutation ids {unknown}", file=sys.stderr)
        return 2
    chosen = [
        m
        for m in MUTATIONS
        if (not args.only or m.id in args.only) and (not args.path or any(_covers(p, m.path) for p in args.path))
    ]
    if not chosen:
        print("mutation_check: no mutation matches --only / --path", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import fedrec_flwr.strategies; print(fedrec_flwr.__file__, fedrec_flwr.strategies.__file__)",
            ],
            cwd=copy,
            env={**os.environ, "PYTHONPATH": str(copy)},
            capture_output=True,
            text=True,
            check=True,
        )
        if not all(Path(p).resolve().is_relative_to(copy.resolve()) for p in probe.stdout.split()):
            raise SystemExit(f"the copy is not what Python imports: {probe.stdout.strip()}")
        for tests in sorted({m.tests for m in chosen}):
            rc, summary, _ = run_tests(copy, tests, args.timeout)
            if rc != 0:
                raise SystemExit(f"unmutated tests fail ({' '.join(tests)}): {summary}")
        survivors = []
        for mutation in chosen:
            original = apply(copy, mutation)
            try:
                rc, summary, seconds = run_tests(copy, mutation.tests, args.timeout)
            finally:
                (copy / mutation.path).write_text(original)
            status = "killed" if rc != 0 else "SURVIVED"
            if rc == 0:
                survivors.append(mutation.id)
            print(
                f"{status:8s} {mutation.id:38s} {seconds:6.1f} s  {summary}"
                + (f"  [{mutation.note}]" if mutation.note else ""),
                flush=True,
            )
        print(f"\n{len(chosen) - len(survivors)} of {len(chosen)} mutants killed; survivors: {survivors or 'none'}")
        return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
