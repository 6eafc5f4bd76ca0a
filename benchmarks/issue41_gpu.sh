#!/usr/bin/env bash
# Issue 41's GPU study on one H200, one device call each (under 10 minutes), results under $OUT:
# `autobalance tune --config studies/gpt-1gpu.toml` (its 5-minute budget) with a fresh Inductor cache,
# compared with the grid of that placement (benchmarks/2026-12-04-h200/grid-*.json, bash benchmarks/issue40_gpu.sh).
#
#   bash benchmarks/issue41_gpu.sh inside|outside SEED      # after ../shared/gpu/fetch-wheels.sh; carry [".whl"]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" || true
placement=${1:?inside or outside}; seed=${2:?seed}
rm -rf /tmp/cs  # a fresh study database and Inductor cache per call (a warm machine keeps /tmp)
flags=(); grid=benchmarks/2026-12-04-h200/grid-inside.json
if [[ $placement == outside ]]; then flags+=(--loss-outside); grid=benchmarks/2026-12-04-h200/grid-outside-2.json; fi
timeout "${STUDY_S:-560}" python3 benchmarks/compiled_search.py --phase studies --strategies model --seeds "$seed" \
  "${flags[@]}" --grid-json "$grid" --work-dir /tmp/cs --study-timeout 540 2>&1 | tee "$OUT/study-$placement-$seed.log"
echo "rc=$?" >> "$OUT/study-$placement-$seed.log"
cp /tmp/cs/studies.db "$OUT/study-$placement-$seed.db" 2>/dev/null || true
ls -la "$OUT"
