#!/usr/bin/env bash
# Install fedrec-flwr into .venv (CPU build of torch first) and run the default experiment with `flwr run`:
# MovieLens-100K, 943 per-user clients, FedNCF, fraction-train 0.1, 100 rounds. Extra arguments are run-config
# overrides, e.g.  bash experiments/quickstart.sh "num-server-rounds=20" "model='mf'"
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"

# Data: $FEDREC_DATA_DIR, else ../shared/data/ml-100k if present, else download (sha256-checked) into the cache.
DATA_DIR="${FEDREC_DATA_DIR:-}"
if [ -z "$DATA_DIR" ] && [ -d ../shared/data/ml-100k ]; then
  DATA_DIR="$(cd ../shared/data/ml-100k && pwd)"
fi
export OMP_NUM_THREADS=1
exec .venv/bin/python -m fedrec_flwr.launch run "data-dir='$DATA_DIR'" "results-dir='$PWD/results'" "$@"
