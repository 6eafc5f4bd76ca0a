#!/usr/bin/env bash
# Issue 30's GPU runs on one H200, one piece per device call (each well under 10 minutes), results under $OUT.
#
#   bash benchmarks/issue30_gpu.sh grid inside|outside        # the reference grid of one loss placement
#   bash benchmarks/issue30_gpu.sh study inside|outside SEED [auto]   # one `tune --time-budget 5m` study
#   bash benchmarks/issue30_gpu.sh followups                # the 2026-12-03 leftovers: trial 10's verification
#                                                           # to its verdict, Lightning compiled with room to compile
#
# Before each call: `../shared/gpu/fetch-wheels.sh` once here (fills .whl/), carry [".whl"]. A study
# compares against the grid of its placement: copy the grid's JSON from the call that made it into
# benchmarks/<date>-h200/ (tracked files travel) and pass it as GRID=path. The Inductor cache travels as
# $CACHE_TAR (a path in the tree) when it is small enough; else each call compiles afresh (the grid's
# compile_s and the studies' FX hits say which).
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" || true
what=${1:?grid, study or followups}
if [[ $what == followups ]]; then
  # 1. 2026-12-03-h200c's trial 10 (11,11,10 fp16 compiled, 141.7 ms) failed verification with a TypeError, fixed
  #    in c587c64; 2026-12-03-h200d's re-run passed the old failure point but was cut by the call's limit
  args=$(python3 -c 'import tomllib; print(" ".join(tomllib.load(open("studies/gpt-1gpu.toml", "rb"))["tune"]["script_args"]))')
  # shellcheck disable=SC2086
  timeout 300 python3 -m autobalance verify examples/gpt/train.py --config benchmarks/2026-12-03-h200c/trial10.json \
    --device cuda --runs-dir /tmp/v --trial-timeout 270 --json -- $args > "$OUT/verify_trial10.json" \
    2> "$OUT/verify_trial10.err" || echo "verify rc=$?" >> "$OUT/verify_trial10.err"
  # 2. Lightning compiled: its first compile took 70.5 s (h200b) and hit h200d's 75 s per-run limit
  timeout 190 python3 benchmarks/integrations_gpu.py --only lightning --timeout 170 --steps 12 \
    --out "$OUT/integrations_lightning.json" 2>&1 | tee "$OUT/integrations_lightning.log"
  exit 0
fi
placement=${2:?inside or outside}
flags=()
[[ $placement == outside ]] && flags+=(--loss-outside)
cache=()
[[ -n ${CACHE_TAR:-} ]] && cache=(--cache-tar "$CACHE_TAR")
case $what in
  grid)  # eager 4/8 x 0/8 checkpointed blocks; compiled 8/16 x budgets 0.75/1.0, default and CUDA graphs: 8 compiles,
         # about 6 minutes (the known best configurations of this scenario are 8 x 4 at 0.75-1.0, issue 30)
    python3 benchmarks/compiled_search.py --phase grid "${flags[@]}" "${cache[@]}" --work-dir /tmp/cs \
      --grid-eager-micro-batches 4,8 --grid-checkpoints 0,8 --grid-micro-batches 8,16 --grid-budgets 0.75,1.0 \
      --grid-compile-modes default,reduce-overhead --steps 6 --warmup 2 2>&1 | tee "$OUT/grid-$placement.log" ;;
  study)
    seed=${3:?seed}; mode=${4:-}
    extra=()
    [[ -n $mode ]] && extra+=(--compile-mode "$mode")
    [[ -n ${GRID:-} ]] && extra+=(--grid-json "$GRID")
    python3 benchmarks/compiled_search.py --phase studies --strategies model --seeds "$seed" "${flags[@]}" \
      "${extra[@]}" --work-dir /tmp/cs 2>&1 | tee "$OUT/study-$placement-$seed${mode:+-$mode}.log" ;;
  *) echo "usage: $0 grid|study inside|outside [seed [auto]]" >&2; exit 2 ;;
esac
