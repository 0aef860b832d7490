#!/bin/bash
# usage: startup.sh <max-in-flight>; prints seconds from start to the "results in" line and to round 1
cd /work/main
export FEDREC_DATA_DIR=/work/shared/data OMP_NUM_THREADS=1 FLWR_HOME=/work/main/.flwr
start=$(date +%s.%N)
.venv/bin/python -m fedrec_flwr.launch run results-dir=/tmp/startup-res dataset=filmtrust num-server-rounds=1 fraction-evaluate=0.0 max-in-flight=$1 2>&1 | while IFS= read -r line; do
  now=$(date +%s.%N)
  case "$line" in
    *"results in"*) echo "max-in-flight=$1 identified $(echo "$now - $start" | bc) s";;
    *"round    1 "*) echo "max-in-flight=$1 round1-done $(echo "$now - $start" | bc) s";;
  esac
done
echo "max-in-flight=$1 total $(echo "$(date +%s.%N) - $start" | bc) s load $(cut -d' ' -f1 /proc/loadavg)"
