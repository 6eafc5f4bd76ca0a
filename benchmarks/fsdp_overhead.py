"""What FSDP2's ``fully_shard`` alone costs: ``studies/gpt-1gpu.toml``'s model on one GPU, world size 1.

At one rank nothing is sharded (each rank holds ``1/1`` of every unit), so the difference between
``param_sharding='off'`` (plain module; DDP is not built at world size 1) and ``embeddings`` /
``blocks`` is FSDP2's own machinery: DTensor parameters, the pre/post-forward and backward hooks,
the all-gather and reduce-scatter copies (into and out of the flat buffers, a no-op collective at
world size 1) and the clipping over DTensor gradients. Each configuration runs in its own process
(``torchrun --nproc-per-node 1``): the ~270M GPT (16 x 1024, 1024 tokens, 32k vocabulary, the
study's script arguments, no EMA copy: its update reads every weight), bf16, micro-batch 8 x 4
micro-steps, AdamW fused, clipping at 1.0; 3 warm-up steps, then ``--steps`` timed steps (CUDA
synchronised at each step's end). Records per configuration: median and IQR of the step time, the
peak allocated and reserved memory.

    python benchmarks/fsdp_overhead.py                  # one GPU, ~3 min; results in $OUT (or benchmarks/<date>-gpu)
    python benchmarks/fsdp_overhead.py --small --cpu    # a CPU smoke run of the same code (seconds)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GPT_1GPU = {"n_layer": 16, "n_embd": 1024, "n_head": 16, "block_size": 1024, "vocab": 32768}
"""``studies/gpt-1gpu.toml``'s model (its ``script_args``)."""
SMALL = {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32, "vocab": 1024}
CONFIGS = ["off", "embeddings", "blocks"]


def child(args: argparse.Namespace) -> None:
    import torch

    import autobalance as ab

    spec = importlib.util.spec_from_file_location("gpt_example", REPO / "examples" / "gpt" / "train.py")
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    shape = SMALL if args.small else GPT_1GPU
    device = "cpu" if args.cpu else "cuda"
    config = ab.BalanceConfig(micro_batches=[args.micro_batch], accumulation=4, global_batch=4 * args.micro_batch,
                              dtype="fp32" if args.cpu else "bf16", param_sharding=args.child)
    plan = ab.plan(config=config, device=device)
    torch.manual_seed(0)
    with torch.device(plan.device):
        model = gpt.GPT(vocab=shape["vocab"], block_size=shape["block_size"], n_layer=shape["n_layer"],
                        n_embd=shape["n_embd"], n_head=shape["n_head"], dropout=0.0)
    model = plan.wrap(model, loss=gpt.lm_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device == "cuda")
    samples = 4 * args.micro_batch * (args.steps + 3)
    data = torch.randint(0, shape["vocab"], (samples, shape["block_size"] + 1), generator=torch.Generator().manual_seed(1))
    loader = plan.dataloader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), shuffle=False)
    times: list[float] = []
    start = time.perf_counter()
    for i, micro_batches in enumerate(plan.steps(loader)):
        for x, y in micro_batches:
            with plan.micro_step():
                plan.backward(model(x.to(plan.device), y.to(plan.device)))
        plan.optimizer_step(optimizer, clip_grad_norm=1.0)
        if device == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if i >= 3:
            times.append(now - start)
        start = now
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    out = {"param_sharding": args.child, "config": config.to_dict(), "steps": len(times),
           "step_ms_median": 1000 * statistics.median(times), "step_ms_iqr": [1000 * q[0], 1000 * q[2]],
           "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else None,
           "units": (plan.model_info.get("param_sharding") or {}).get("units")}
    Path(args.result).write_text(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--small", action="store_true", help="a tiny GPT (smoke run)")
    p.add_argument("--cpu", action="store_true", help="on the CPU, fp32 (smoke run)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    p.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    out_dir = Path(os.environ.get("OUT") or REPO / "benchmarks" / f"{datetime.date.today()}-gpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for name in CONFIGS:
        result = out_dir / f"fsdp_overhead_{name}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "127.0.0.1:0", __file__, "--child", name, "--result", str(result),
               "--steps", str(args.steps), "--micro-batch", str(args.micro_batch),
               *(["--small"] if args.small else []), *(["--cpu"] if args.cpu else [])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO,
                                  env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")})
            ok = proc.returncode == 0 and result.exists()
            results.append(json.loads(result.read_text()) if ok else
                           {"param_sharding": name, "error": (proc.stderr or proc.stdout)[-2000:]})
        except subprocess.TimeoutExpired:
            results.append({"param_sharding": name, "error": f"timed out after {args.timeout:.0f} s"})
    device = "cpu"
    if not args.cpu:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    base = next((r for r in results if r.get("param_sharding") == "off" and "error" not in r), None)
    for r in results:
        if base is not None and "error" not in r:
            r["overhead_vs_off"] = r["step_ms_median"] / base["step_ms_median"] - 1.0
    summary = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": device,
               "model": SMALL if args.small else GPT_1GPU, "world_size": 1, "results": results}
    (out_dir / "fsdp_overhead.json").write_text(json.dumps(summary, indent=1))
    for r in results:
        line = r.get("error", "").splitlines()[-1:] if "error" in r else None
        print(f"{r['param_sharding']:>10}: " + (f"error {line}" if line is not None else
              f"{r['step_ms_median']:.1f} ms (IQR {r['step_ms_iqr'][0]:.1f}-{r['step_ms_iqr'][1]:.1f}), "
              f"overhead {100 * r.get('overhead_vs_off', 0.0):+.1f}%"))
    print(f"results: {out_dir / 'fsdp_overhead.json'}")


if __name__ == "__main__":
    main()
