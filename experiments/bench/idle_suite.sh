#!/usr/bin/env bash
# The speed acceptance ratios (simulation and deployment) in one go, for the idle 2-core machine (about 20 minutes; 25 at most).
# Run from the checkout's root with nothing else running:  bash experiments/bench/idle_suite.sh
# Every step's raw output goes to experiments/bench/results/idle-<UTC stamp>/ with the load average before and after;
# summary.md there holds the ratios (experiments/bench/idle_summary.py). A failed step is logged and the suite goes on.
#   SMALL=1            a smoke test of the suite itself (tiny scales, about 5 minutes; numbers meaningless)
#   DEPLOYED_ROUNDS=N  also time N rounds on 3 real SuperNodes (whole deployed rounds; default 4, 0 = skip; ~4 min)
#   QUICKSTART_OURS=1  also run our default quickstart right after the bare one (adds ~9 minutes: over budget)
set -uo pipefail
cd "$(dirname "$0")/../.."

export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export FEDREC_DATA_DIR="${FEDREC_DATA_DIR:-$(cd ../shared/data 2>/dev/null && pwd)}"
PY=.venv/bin/python
OUT="experiments/bench/results/idle-$(date -u +%Y%m%dT%H%M)"
mkdir -p "$OUT"
SMALL="${SMALL:-0}"
DEPLOYED_ROUNDS="${DEPLOYED_ROUNDS:-4}"

if [ "$SMALL" = 1 ]; then
  SIM_ROUNDS=2; SIM_BIG=ml-100k:300:1; REPEATS=2; QS_ROUNDS=3; QS_EVERY=3; PROFILE_MESSAGES=40
  [ "$DEPLOYED_ROUNDS" -gt 2 ] && DEPLOYED_ROUNDS=2
else
  SIM_ROUNDS=3; SIM_BIG=ml-100k:943:1; REPEATS=5; QS_ROUNDS=100; QS_EVERY=10; PROFILE_MESSAGES=150
fi

log() { echo "[$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)] $*" | tee -a "$OUT/suite.log"; }
step() {  # step NAME COMMAND...: run, keep stdout+stderr in $OUT/NAME.log, never stop the suite
  local name=$1; shift
  log "start $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  log "end $name: exit $? after $((SECONDS - t0)) s"
}

{
  echo "commit $(git rev-parse --short HEAD) ($(git status --porcelain --untracked-files=no | wc -l) modified files)"
  echo "date $(date -u)"; echo "nproc $(nproc)"; uptime; free -m
  $PY -c 'import flwr, torch, numpy; print("flwr", flwr.__version__, "torch", torch.__version__, "numpy", numpy.__version__)'
  echo "other processes using CPU:"; ps -eo pid,ni,pcpu,etime,args --sort=-pcpu | head -8 | cut -c1-150
} > "$OUT/env.txt" 2>&1
log "suite start (SMALL=$SMALL) -> $OUT"

# 1. One message in a simulation worker: ours against a bare ClientApp, by phase (~1 min).
step profile_message $PY experiments/bench/profile_message.py --messages "$PROFILE_MESSAGES" --repeats 3 --before

# 2. Per message on Flower's simulation engine, one user per node, vs a bare app sending the same 0.44 MB model:
#    100 sampled users of 943 nodes (twice, the second in reverse order), then all 943 (~7 min).
step sim_100 $PY experiments/bench/bench_simulation.py --rounds "$SIM_ROUNDS" --cases ml-100k:100:1 \
  --apps bare+model fedrec fedrec bare+model --out "$OUT/sim_100.json"
step sim_943 $PY experiments/bench/bench_simulation.py --rounds "$SIM_ROUNDS" --cases "$SIM_BIG" \
  --apps bare+model fedrec --out "$OUT/sim_943.json"

# 3. Deployed cold start per message (fresh process per message, as flwr-clientapp) vs the bare app, and what our
#    ClientApp imports beyond it (~3 min, +~4 min with DEPLOYED_ROUNDS on 3 real SuperNodes).
step imports $PY experiments/bench/import_breakdown.py --repeats 3 --out "$OUT/imports.json"
if [ "$DEPLOYED_ROUNDS" -gt 0 ]; then
  step deploy $PY experiments/bench/bench_deploy.py --repeats "$REPEATS" --deployed "$DEPLOYED_ROUNDS" --out "$OUT/deploy.json"
else
  step deploy $PY experiments/bench/bench_deploy.py --repeats "$REPEATS" --out "$OUT/deploy.json"
fi

# 4. The default quickstart's message pattern through flwr run with a bare app (the quickstart target: is
#    0.4 x 17 min reachable with one user per node on this engine?) (~7 min; +~9 with QUICKSTART_OURS=1).
step quickstart_bare $PY experiments/bench/bench_quickstart_bare.py --rounds "$QS_ROUNDS" --eval-every "$QS_EVERY" \
  ${QUICKSTART_OURS:+--ours} --out "$OUT/quickstart_bare.json"

step summary $PY experiments/bench/idle_summary.py "$OUT"
cp "$OUT/summary.log" "$OUT/summary.md" 2>/dev/null
log "suite end"
cat "$OUT/summary.md" 2>/dev/null
