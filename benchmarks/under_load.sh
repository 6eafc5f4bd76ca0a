#!/usr/bin/env bash
# Run one pytest selection N times in a row while busy loops keep every core loaded; stop at the
# first failure. Used for the "passes 20 runs in a row on a loaded 2-core machine" checks.
#
#   benchmarks/under_load.sh RUNS BURNERS LOG -- PYTEST_ARGS...
#   benchmarks/under_load.sh 20 2 benchmarks/2026-12-01-cpu/fault_under_load.txt -- \
#       tests/faults/test_trial_faults.py -k "sigkill_rank1 and cold"
set -euo pipefail
runs=$1 burners=$2 log=$3
shift 3
[[ ${1:-} == -- ]] && shift
mkdir -p "$(dirname "$log")"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
for _ in $(seq "$burners"); do python3 -c 'while True: pass' & pids+=($!); done
{
  echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC') $(nproc) cores, $burners busy loops, commit $(git rev-parse --short HEAD)"
  echo "# python -m pytest $*"
} > "$log"
passed=0
for i in $(seq "$runs"); do
  start=$(date +%s)
  if timeout 900 python -m pytest -q -p no:cacheprovider "$@" > /tmp/under_load_run.txt 2>&1; then
    passed=$((passed + 1))
    echo "run $i: passed in $(( $(date +%s) - start )) s, load $(cut -d' ' -f1 /proc/loadavg)" >> "$log"
  else
    echo "run $i: FAILED after $(( $(date +%s) - start )) s" >> "$log"
    tail -40 /tmp/under_load_run.txt >> "$log"
    break
  fi
done
echo "# $passed of $runs runs passed in a row" >> "$log"
[[ $passed == "$runs" ]]
