"""Mutation check, run by hand: apply single-line mutations to a temporary copy of the package and run the fast tests
that should notice each one. A mutant that leaves its tests green "survives": either the tests miss a behaviour that
matters (add a test), or the change is invisible by design (explain it).

Usage (from the project root; a few minutes on 2 cores):

    OMP_NUM_THREADS=1 FEDREC_SHARED_DATA=../shared/data .venv/bin/python scripts/mutation_check.py [--only ID ...]

The working tree is never modified: the code (``fedrec_flwr``, ``strategies``, ``clients``, ``experiments/*.py``,
``tests``) is copied to a temporary folder, which is put first on ``PYTHONPATH`` (checked: the tests import the
copy, not the editable install). Each mutation names the text it replaces, which must occur in the file exactly as
often as stated, so a mutation that no longer applies fails loudly instead of testing nothing. The unmutated copy's
tests run first and must pass. No Ray test is used (they take fixed ports and minutes).
"""

from __future__ import annotations

import argparse
import os
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
STRATEGY_TESTS = ("tests/test_item_fedavg_strategy.py", "tests/test_strategy_plugin.py",
                  "tests/test_server_optimizer_strategy.py", "tests/test_simulation_properties.py")


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
    # ---- issue 23's mutations 2-4 (1, the GRL sign, belongs to the FedAU2 rewrite)
    Mutation("sam-swap-radii", "fedrec_flwr/sam.py", (
        one("sam_gradient(shared, base_shared, self.rho_shared, loss_fn)",
            "sam_gradient(shared, base_shared, self.rho_private, loss_fn)"),
        one("sam_gradient(private, base_private, self.rho_private, loss_fn)",
            "sam_gradient(private, base_private, self.rho_shared, loss_fn)")), SAM_TESTS, "issue 23, mutation 2"),
    Mutation("sam-joint-perturbation", "fedrec_flwr/sam.py", (
        one("sam_shared, _ = sam_gradient(shared, base_shared, self.rho_shared, loss_fn)",
            "joint, _ = sam_gradient(everything, base_private + base_shared, self.rho_shared, loss_fn); "
            "sam_private, sam_shared = joint[:len(private)], joint[len(private):]"),
        one("sam_private, _ = sam_gradient(private, base_private, self.rho_private, loss_fn)", "pass")),
        SAM_TESTS, "issue 23, mutation 2 (plain SAM: one perturbation of both groups)"),
    Mutation("evaluate-unweighted-mean", "strategies/item_fedavg.py", (
        one("metrics = aggregate_metricrecords(ok, NUM_EXAMPLES)",
            "metrics = aggregate_metricrecords([RecordDict({METRICS: MetricRecord({**dict(r[METRICS]), "
            "NUM_EXAMPLES: 1.0})}) for r in ok], NUM_EXAMPLES)"),), STRATEGY_TESTS, "issue 23, mutation 3"),
    Mutation("sam-no-restore-calls", "fedrec_flwr/sam.py", (
        one("self._restore(snapshot, ", "raise FloatingPointError(", 3),), SAM_TESTS, "issue 23, mutation 4"),
    Mutation("restore-copies-nothing", "fedrec_flwr/training.py", (one("p.copy_(buf)", "pass"),), SAM_TESTS,
             "issue 23, mutation 4 (the restore itself)"),
    Mutation("blocks-sam-swap-radii", "fedrec_flwr/blocks.py", (
        one("perturbed(shared_keys, base, cfg.rho_shared)", "perturbed(shared_keys, base, cfg.rho_private)"),
        one("perturbed(block.private_keys, base, cfg.rho_private)", "perturbed(block.private_keys, base, cfg.rho_shared)"),
    ), ("tests/test_blocks.py",), "issue 23, mutation 2 in the vectorized user blocks (checked against SAMTrainer)"),
    # ---- sam.py
    Mutation("sam-perturbation-not-normalised", "fedrec_flwr/sam.py", (one("scale = rho / float(norm)", "scale = rho"),),
             SAM_TESTS),
    Mutation("sam-squared-norm", "fedrec_flwr/sam.py", (
        one("torch.sqrt(sum((g.double() ** 2).sum() for g in present))", "sum((g.double() ** 2).sum() for g in present)"),
    ), SAM_TESTS),
    Mutation("sam-gradient-keeps-the-perturbation", "fedrec_flwr/sam.py", (one("p.copy_(s)", "pass"),), SAM_TESTS),
    Mutation("sam-shared-grads-sum-over-steps", "fedrec_flwr/sam.py", (one("s / epochs", "s"),), SAM_TESTS),
    Mutation("sam-loss-not-divided-by-chunks", "fedrec_flwr/sam.py", (one("return value / chunks, n", "return value, n"),),
             SAM_TESTS),
    Mutation("sam-private-step-skipped", "fedrec_flwr/sam.py", (one("        self.optimizer.step()\n", "        pass\n"),),
             SAM_TESTS),
    # ---- metrics.py
    Mutation("rank-ties-for-the-model", "fedrec_flwr/metrics.py", (
        one("(values >= values[int(target_index)]).sum()", "(values > values[int(target_index)]).sum()"),), METRIC_TESTS),
    Mutation("batch-rank-ties-for-the-model", "fedrec_flwr/metrics.py", (
        one("(values >= target_scores)", "(values > target_scores)"),), METRIC_TESTS),
    Mutation("ndcg-off-by-one", "fedrec_flwr/metrics.py", (one("math.log2(rank + 2)", "math.log2(rank + 3)"),),
             METRIC_TESTS),
    Mutation("batch-ndcg-off-by-one", "fedrec_flwr/metrics.py", (one("np.log2(ranks + 2.0)", "np.log2(ranks + 3.0)"),),
             METRIC_TESTS),
    Mutation("hit-inclusive", "fedrec_flwr/metrics.py", (one("1.0 if rank < k else 0.0", "1.0 if rank <= k else 0.0"),),
             METRIC_TESTS),
    Mutation("batch-hit-inclusive", "fedrec_flwr/metrics.py", (one("hit = ranks < k", "hit = ranks <= k"),),
             METRIC_TESTS),
    Mutation("k-zero-accepted", "fedrec_flwr/metrics.py", (one("or k < 1 for k in ks", "or k < 0 for k in ks"),),
             METRIC_TESTS),
    Mutation("nan-scores-accepted", "fedrec_flwr/metrics.py", (one("if np.isnan(values).any():", "if False:", 2),),
             METRIC_TESTS),
    Mutation("mean-is-median", "fedrec_flwr/metrics.py", (one("float(np.mean(values))", "float(np.median(values))"),),
             METRIC_TESTS),
    # ---- wire.py
    Mutation("contribution-dense-unweighted", "fedrec_flwr/wire.py", (
        one("value = np.asarray(dense[key], dtype=np.float64) * num_examples",
            "value = np.asarray(dense[key], dtype=np.float64)"),), WIRE_TESTS),
    Mutation("contribution-row-count-not-summed", "fedrec_flwr/wire.py", (
        one("counts[where] += 1.0", "counts[where] = 1.0"),), WIRE_TESTS),
    Mutation("contribution-row-sum-not-summed", "fedrec_flwr/wire.py", (
        one("sums[where] += values", "sums[where] = values"),), WIRE_TESTS),
    Mutation("merge-touched-divides-by-all", "fedrec_flwr/wire.py", (
        one("(total[touched] / count[touched].reshape(shape))", "(total[touched] / count.sum())"),), WIRE_TESTS),
    Mutation("merge-selected-ignores-count", "fedrec_flwr/wire.py", (
        one("(total[touched] - count[touched].reshape(shape) * base) / num_users", "(total[touched] - base) / num_users"),
    ), WIRE_TESTS + ("tests/test_method_clients.py",)),
    Mutation("sampling-ignores-the-round", "fedrec_flwr/wire.py", (
        one("np.random.default_rng([seed, 0x5A3B, tag, server_round])", "np.random.default_rng([seed, 0x5A3B, tag])"),
    ), WIRE_TESTS),
    Mutation("private-key-with-suffix-accepted", "fedrec_flwr/wire.py", (
        one('if key.split("#", 1)[0] in private:\n            raise PrivacyViolation(f"a client reply carries',
            'if key in private:\n            raise PrivacyViolation(f"a client reply carries'),), WIRE_TESTS),
    Mutation("zero-row-count-accepted", "fedrec_flwr/wire.py", (one("counts.min() <= 0", "counts.min() < 0"),),
             WIRE_TESTS),
    # ---- item_fedavg.py aggregation
    Mutation("dense-average-unweighted", "strategies/item_fedavg.py", (
        one("RecordDict({ARRAYS: ArrayRecord({k: r[ARRAYS][k] for k in dense_keys}), METRICS: r[METRICS]})",
            "RecordDict({ARRAYS: ArrayRecord({k: r[ARRAYS][k] for k in dense_keys}), "
            "METRICS: MetricRecord({NUM_EXAMPLES: 1.0})})"),), STRATEGY_TESTS),
    Mutation("zero-weight-reply-accepted", "strategies/item_fedavg.py", (one("or weight <= 0:", "or weight < 0:"),),
             STRATEGY_TESTS),
    Mutation("replied-users-counts-replies", "strategies/item_fedavg.py", (
        one('float(sum(float(r[METRICS].get("num-users", 0)) for r in accepted))', "float(len(accepted))"),),
        STRATEGY_TESTS + ("tests/test_method_clients.py",)),
    Mutation("min-train-fraction-floor", "strategies/item_fedavg.py", (
        one("math.ceil(self.min_train_fraction * expected)", "math.floor(self.min_train_fraction * expected)"),),
        STRATEGY_TESTS),
    Mutation("eval-users-counts-replies", "strategies/item_fedavg.py", (
        one("float(sum(float(r[METRICS][NUM_EXAMPLES]) for r in ok))", "float(len(ok))"),), STRATEGY_TESTS),
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
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "timeout", time.perf_counter() - started
    lines = [l for l in done.stdout.splitlines() if l.startswith(("FAILED", "ERROR")) or " passed" in l
             or " failed" in l]
    return done.returncode, "; ".join(lines[-3:]), time.perf_counter() - started


def apply(copy: Path, mutation: Mutation) -> str:
    path = copy / mutation.path
    original = path.read_text()
    text = original
    for old, new, count in mutation.replacements:
        found = text.count(old)
        if found != count:
            raise SystemExit(f"mutation {mutation.id}: {old!r} occurs {found} times in {mutation.path}, expected {count}")
        text = text.replace(old, new)
    path.write_text(text)
    return original


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutation ids to run (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.id in args.only]
    if args.only and len(chosen) != len(args.only):
        raise SystemExit(f"unknown mutation ids: {sorted(set(args.only) - {m.id for m in MUTATIONS})}")
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = Path(tmp)
        copy_tree(copy)
        probe = subprocess.run([sys.executable, "-c", "import fedrec_flwr, strategies; print(fedrec_flwr.__file__, "
                                "fedrec_flwr.strategies.__file__)"], cwd=copy, env={**os.environ, "PYTHONPATH": str(copy)},
                               capture_output=True, text=True, check=True)
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
            print(f"{status:8s} {mutation.id:38s} {seconds:6.1f} s  {summary}" + (f"  [{mutation.note}]" if mutation.note
                                                                                else ""), flush=True)
        print(f"\n{len(chosen) - len(survivors)} of {len(chosen)} mutants killed; survivors: {survivors or 'none'}")
        return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
