#!/usr/bin/env bash
# Which torchrun agent hosts the c10d rendezvous store, and what its exit does to the next trial
# (CPU, loopback, about a minute). A "stale" agent of an earlier rendezvous id starts first and binds
# the endpoint's port; a trial (rendezvous id t1, 2 nodes x 1 rank, 20 all-reduces a second apart)
# then joins the same endpoint; 12 s in, the stale agent is SIGKILLed, as a worker's torchrun that
# outlived its trial ends. Run twice: as torch decides (any agent on the endpoint's machine may host),
# and as autobalance starts a worker node (`--rdzv-conf is_host=false` on the stale agent and the
# worker: only the coordinator hosts). Prints each trial's two exit codes.
#
#     bash benchmarks/rdzv_store_host.sh
set -u
dir=$(mktemp -d)
trap 'pkill -9 -f "$dir" 2>/dev/null; rm -rf "$dir"' EXIT
cat > "$dir/step.py" <<'PY'
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for _ in range(20):
    t = torch.ones(1); dist.all_reduce(t); time.sleep(1)
print("rank", dist.get_rank(), "done", flush=True)
PY
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
for mode in torch-decides worker-never-hosts; do
  p=$(port)
  tr=(timeout 120 python3 -m torch.distributed.run --nproc-per-node 1 --nnodes 2 --rdzv-backend c10d
      --rdzv-endpoint "127.0.0.1:$p" --max-restarts 0)
  worker=()
  [ "$mode" = worker-never-hosts ] && worker=(--rdzv-conf is_host=false)
  "${tr[@]}" "${worker[@]}" --rdzv-id stale "$dir/step.py" > "$dir/$mode-stale.log" 2>&1 & stale=$!
  sleep 6
  "${tr[@]}" --rdzv-id t1 "$dir/step.py" > "$dir/$mode-coordinator.log" 2>&1 & c=$!
  "${tr[@]}" "${worker[@]}" --rdzv-id t1 "$dir/step.py" > "$dir/$mode-worker.log" 2>&1 & w=$!
  sleep 12
  pkill -9 -P "$stale" 2>/dev/null  # the agent itself (the child of `timeout`): its store goes with it
  wait "$c"; crc=$?
  wait "$w"; wrc=$?
  echo "$mode: trial t1 coordinator rc=$crc worker rc=$wrc; ranks done: $(cat "$dir/$mode-coordinator.log" "$dir/$mode-worker.log" | grep -c ' done')"
done
