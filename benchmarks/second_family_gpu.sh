#!/usr/bin/env bash
# The second model family's grid on one H200, one device call per loss placement (under 10 minutes),
# results under $OUT: the same GPT as studies/gpt-1gpu.toml with a 4x vocabulary (131072 tokens: most
# of a sample's memory in its logits), recorded exactly as the first family's grid was
# (benchmarks/issue40_gpu.sh: benchmarks/compiled_search.py --phase grid in the product's warm pool,
# a fresh Inductor cache, 6 steps after 2 warm-up, uncapped and judged against the cap afterwards).
#
#   bash benchmarks/second_family_gpu.sh inside      # after ../shared/gpu/fetch-wheels.sh; carry [".whl"]
#   bash benchmarks/second_family_gpu.sh outside
#
# Writes $OUT/second-grid-PLACEMENT.json (+ .log, .md), gpu.csv, torch.txt. The replay then runs on the
# recorded second family instead of the derived one:
#   python benchmarks/replay_search.py --machines second --second-grids DIR_WITH_BOTH_JSONS ...
# Points are SCOPE/SPLIT/X (compiled_search.py point_config): the first family's points, the eager ones
# the replay's eager model needs, and 5,5,5,5,4,4,4 (a7) in both scopes, the two-size split whose
# compiled cost the replay charges at 1.5x the even splits until measured.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the results folder}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" || true
python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' > "$OUT/torch.txt" 2>&1 || true
placement=${1:?inside or outside}
case $placement in
  inside) flags=(); suffix=""
    points=${POINTS:-regional/16/1.0,regional/16/0.5,regional/16/0.3,regional/8/1.0,regional/8/0.85,regional/8/0.5,whole/8/1.0,whole/16/0.5,regional/4/1.0,regional/a7/1.0,whole/a7/1.0,eager/4/0,eager/8/0,eager/4/8} ;;
  outside) flags=(--loss-outside); suffix="-loss-outside"
    points=${POINTS:-regional/8/1.0,regional/8/0.85,regional/8/0.7,regional/8/0.5,regional/4/1.0,regional/16/0.5,whole/8/1.0,whole/8/0.75,regional/a7/1.0,whole/a7/1.0,eager/4/0,eager/8/0,eager/4/8} ;;
  *) echo "second_family_gpu.sh: placement '$placement' is neither inside nor outside; give one of them" >&2; exit 2 ;;
esac
rm -rf "/tmp/second-$placement"  # a fresh Inductor cache per call (a warm machine keeps /tmp)
timeout "${GRID_S:-560}" python3 benchmarks/compiled_search.py --phase grid "${flags[@]}" --script-arg vocab=131072 \
  --memory-cap-gib "${CAP_GIB:-30}" --grid-points "$points" --work-dir "/tmp/second-$placement" --steps 6 --warmup 2 \
  --trial-timeout 150 > "$OUT/second-grid-$placement.log" 2>&1
echo "rc=$?" >> "$OUT/second-grid-$placement.log"
# compiled_search writes its grid after every point: a call cut short keeps what it measured
mv "$OUT/compiled_search_grid$suffix.json" "$OUT/second-grid-$placement.json" 2>/dev/null || true
mv "$OUT/compiled_search$suffix.md" "$OUT/second-grid-$placement.md" 2>/dev/null || true
ls -la "$OUT"
