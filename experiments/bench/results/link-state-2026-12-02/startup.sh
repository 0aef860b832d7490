#!/bin/bash
# usage: startup.sh <tree> <label> [key=value ...]; seconds from the command's start to the "results in" line (after identify) and to the end
tree=$1; label=$2; shift 2
cd $tree
export FEDREC_DATA_DIR=/work/shared/data OMP_NUM_THREADS=1 FLWR_HOME=$tree/.flwr PYTHONPATH=$tree
start=$(date +%s.%N)
/work/main/.venv/bin/python -m fedrec_flwr.launch run results-dir=/tmp/b7/startup-res dataset=filmtrust num-server-rounds=1 fraction-evaluate=0.0 "$@" > /tmp/b7/startup-$label.log 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null; do
  if [ -z "$ident" ] && grep -q "results in" /tmp/b7/startup-$label.log; then ident=$(echo "$(date +%s.%N) - $start" | bc); fi
  sleep 0.1
done
wait $pid; rc=$?
echo "$label identified ${ident:-?} s total $(echo "$(date +%s.%N) - $start" | bc) s rc $rc load $(cut -d' ' -f1-3 /proc/loadavg) $(grep -o 'identify: .*' /tmp/b7/startup-$label.log)"
