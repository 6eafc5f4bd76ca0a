#!/usr/bin/env bash
# Issue 40/41's grid on one H200, one device call (under 10 minutes), results under $OUT: the product's
# own runtime (examples/gpt/train.py with studies/gpt-1gpu.toml's arguments, one warm pool per loss
# placement, a fresh Inductor cache) at whole-model and regional compile scopes.
#
#   bash benchmarks/issue40_gpu.sh          # after ../shared/gpu/fetch-wheels.sh here; carry [".whl"]
#
# Each point: compile time, step time (6 steps after 2 warm-up), peaks, FX/AOTAutograd cache hits,
# graphs. Points are SCOPE/SPLIT/BUDGET (benchmarks/compiled_search.py point_config).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" || true
python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' > "$OUT/torch.txt" 2>&1 || true
inside=${INSIDE:-regional/16/1.0,regional/16/0.85,regional/16/0.5,regional/8/1.0,regional/8/0.85,regional/8/0.5,whole/8/1.0,whole/16/0.5,regional/32/0.5,regional/a3/0.85,regional/4/1.0}
outside=${OUTSIDE:-regional/16/1.0,regional/16/0.85,regional/16/0.5,regional/8/1.0,regional/8/0.85,whole/8/1.0}
timeout "${INSIDE_S:-360}" python3 benchmarks/compiled_search.py --phase grid --grid-points "$inside" \
  --work-dir /tmp/cs-in --steps 6 --warmup 2 --trial-timeout 150 > "$OUT/grid-inside.log" 2>&1
echo "inside rc=$?" >> "$OUT/grid-inside.log"
timeout "${OUTSIDE_S:-200}" python3 benchmarks/compiled_search.py --phase grid --loss-outside --grid-points "$outside" \
  --work-dir /tmp/cs-out --steps 6 --warmup 2 --trial-timeout 150 > "$OUT/grid-outside.log" 2>&1
echo "outside rc=$?" >> "$OUT/grid-outside.log"
ls -la "$OUT"
