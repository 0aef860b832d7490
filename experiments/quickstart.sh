#!/usr/bin/env bash
# Install fedrec-flwr into .venv (torch first) and run the default experiment with `flwr run`:
# MovieLens-100K, 943 per-user clients, FedNCF, fraction-train 0.1, 100 rounds. Extra arguments are run-config
# overrides and launcher flags in any order, e.g.  bash experiments/quickstart.sh num-server-rounds=20 model=mf --verbose
# (python -m fedrec_flwr.launch run --help lists the flags). The exit status is 0 only when the run finished.
# torch: a plain `pip install torch==2.13.0`, so pip's configured sources pick the build (a local CPU wheel where
# find-links has one; from plain PyPI on Linux, the CUDA build). TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# takes it from that index instead (the CPU build; the index must be reachable).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}  # Python 3.11-3.13 (pyproject.toml); 3.11 is what .ci/run tests
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# (Re)install only when pyproject.toml changed since the last install.
if [ ! -f .venv/.fedrec-installed ] || [ pyproject.toml -nt .venv/.fedrec-installed ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[test]"
  touch .venv/.fedrec-installed
fi

# Data: $FEDREC_DATA_DIR if set, else ../shared/data if present (a folder holding ml-100k/, filmtrust/, ...),
# else the files are downloaded (sha256-checked) into the cache ($FEDREC_FLWR_CACHE or ~/.cache/fedrec-flwr).
if [ -z "${FEDREC_DATA_DIR:-}" ] && [ -d ../shared/data ]; then
  export FEDREC_DATA_DIR="$(cd ../shared/data && pwd)"
fi
export OMP_NUM_THREADS=1
# Flower's state (config, installed app copies, local SuperLink database and log) stays in this checkout.
export FLWR_HOME="${FLWR_HOME:-$PWD/.flwr}"
# results under ./results unless the command line names a results-dir of its own
results=("results-dir=$PWD/results")
for arg in "$@"; do
  case "$arg" in results-dir=*) results=() ;; esac
done
exec .venv/bin/python -m fedrec_flwr.launch run ${results[@]+"${results[@]}"} "$@"
