#!/bin/bash
export FEDREC_DATA_DIR=/work/shared/data OMP_NUM_THREADS=1
for tree in /work/wt-old /work/wt-new; do
  cd $tree
  echo "== $tree $(git log --oneline -1 | cut -c1-60) start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  s=$(date +%s.%N)
  FLWR_HOME=$tree/.flwr PYTHONPATH=$tree timeout 1800 /work/main/.venv/bin/python -m fedrec_flwr.launch run results-dir=/tmp/b7/qs-ab/$(basename $tree) > /tmp/b7/qs-ab-$(basename $tree).log 2>&1
  echo "rc=$? wall $(echo "$(date +%s.%N) - $s" | bc) s end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
# /work/wt-old: git worktree of daae3bd; /work/wt-new: of 433a828 (the log says /work/wt-soak)
