#!/usr/bin/env bash
# `autobalance diagnose` on the GPT example across 2 GPUs: rank 0's extras (an EMA copy of the
# weights + a cached validation batch) must be the top cause, with the size the example prints.
# Usage (from the repository root, 2 GPUs): bash benchmarks/diagnose_gpt_gpu.sh OUTDIR
set -u
out=${1:-benchmarks/out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
args=(--n-layer 24 --n-embd 1024 --n-head 16 --block-size 1024 --micro-batch 4 --val-cache-mib 256)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } > "$out/env.txt" 2>&1
COLUMNS=120 $py -m autobalance diagnose examples/gpt/train.py --nproc-per-node 2 --device cuda \
  --runs-dir /tmp/ab_runs "${args[@]}" > "$out/diagnose_gpt_h200x2.txt" 2> "$out/diagnose_stderr.txt"
echo "table exit $?" >> "$out/env.txt"
$py -m autobalance diagnose examples/gpt/train.py --nproc-per-node 2 --device cuda --json \
  --runs-dir /tmp/ab_runs_json "${args[@]}" > "$out/diagnose_gpt_h200x2.json" 2>> "$out/diagnose_stderr.txt"
echo "json exit $?" >> "$out/env.txt"
log=$(find /tmp/ab_runs_json -path '*/0/stdout.log' | head -1)
cp "$log" "$out/rank0_stdout.log" 2>/dev/null
$py - "$out" <<'PY'
import json, re, sys
out = sys.argv[1]
d = json.load(open(f"{out}/diagnose_gpt_h200x2.json"))
printed = float(re.search(r"rank 0 extras: ([0-9.]+) MiB", open(f"{out}/rank0_stdout.log").read()).group(1)) * 2**20
top = d["findings"][0]
line = (f"top finding: {top['cause']} ranks={top['ranks']} size={top['size_bytes'] / 2**20:.1f} MiB; "
        f"example printed {printed / 2**20:.1f} MiB; ratio {top['size_bytes'] / printed:.4f}")
print(line)
open(f"{out}/check.txt", "w").write(line + "\n")
PY
