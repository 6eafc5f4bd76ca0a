#!/usr/bin/env bash
# How often a two-rank CPU (gloo) production job aborts at exit ("terminate called without an active
# exception", SIGABRT): the job of tests/test_partial_steps.py run N times; run two of these side by side
# to load a 2-core machine as CI does. Prints "runs N fails F"; the failures' output goes to $OUT_DIR.
#   bash benchmarks/exit_teardown.sh 15 & bash benchmarks/exit_teardown.sh 15; wait
set -u
n=${1:-15}; out_dir=${OUT_DIR:-/tmp}; fails=0
cd "$(dirname "$0")/.."
for i in $(seq 1 "$n"); do
  out=$(PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 AUTOBALANCE_DEVICE=cpu timeout 120 python -m torch.distributed.run \
        --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \
        tests/scripts/user_train.py --samples 20 --micro-batch 32 --epochs 2 2>&1)
  if [ $? -ne 0 ]; then fails=$((fails + 1)); echo "$out" > "$out_dir/exit_teardown_fail_$$_$i.log"; fi
done
echo "runs $n fails $fails"
