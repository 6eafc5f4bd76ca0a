#!/usr/bin/env bash
# The README's CPU quick start on a fresh clone, each line timed (issue 43: under 3 minutes).
#
#   bash benchmarks/quick_start_time.sh [CLONE_DIR]      # default /tmp/ab-quick-start (removed first)
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-/tmp/ab-quick-start}
rm -rf "$dir" && git clone -q "$src" "$dir" && cd "$dir"
start=$(date +%s)
t() { local name=$1; shift; local t0; t0=$(date +%s); "$@"; echo "$name $(( $(date +%s) - t0 )) s"; }
python3 -m venv .venv && . .venv/bin/activate
t torch pip install -q torch --index-url https://download.pytorch.org/whl/cpu --retries 1
t install pip install -q -e '.[report]'
t demo sh -c 'autobalance tune --config studies/gpt-cpu.toml > tune.log 2>&1'
t views sh -c 'autobalance trials --study-name gpt-cpu > /dev/null && autobalance best --study-name gpt-cpu > /dev/null && autobalance report --study-name gpt-cpu -o report.html > /dev/null'
t dashboard sh -c 'timeout -s INT 8 autobalance dashboard > dashboard.log 2>&1 || true'
t production sh -c 'AUTOBALANCE_STUDY=gpt-cpu timeout 300 torchrun --nproc-per-node 2 examples/gpt/train.py > production.log 2>&1'
echo "total $(( $(date +%s) - start )) s (from the venv on; the clone itself: under a second)"
