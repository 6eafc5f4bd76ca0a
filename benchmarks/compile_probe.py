"""Issue 30: what one compiled graph per micro-batch size, and CUDA graphs with gradient
accumulation, cost and save on the GPU, measured on the ``studies/gpt-1gpu.toml`` model.

Each variant runs in its own process (a fresh Dynamo, its own Inductor cache directory unless
``cache`` says otherwise) with the loss inside the compiled module (as ``plan.wrap(model, loss=...)``
compiles it), bf16 autocast, activation budget 1.0, AdamW, global batch 32 on one GPU:

- ``static-8x4`` / ``static-4x8``: one micro-batch size, the default mode (the baseline of the rest);
- ``static-6655``: the any split 6,6,5,5,5,5 compiled as today (a graph per size: Dynamo recompiles
  for the second size, marking the batch dimension dynamic on that recompile);
- ``dynamic-6655``: the same split with the batch dimension marked dynamic before the first call
  (``torch._dynamo.mark_dynamic``): one graph for both sizes;
- ``warm-8x4``: ``static-8x4`` again on the first one's cache directory (what a cache hit costs);
- ``cudagraphs-4x8`` / ``cudagraphs-8x4``: mode ``reduce-overhead`` (CUDA graphs) with
  accumulation, the gradients allocated before the first backward and kept (``zero_grad(set_to_none=False)``)
  so every micro-step's backward adds into them instead of holding a graph's output,
  ``torch.compiler.cudagraph_mark_step_begin()`` before each micro-step;
- ``cudagraphs-4x8-plain``: the same without keeping the gradients (what failed in issue 30).

Per variant: the first step's seconds (the compile), the median of the next steps (ms), graphs
compiled, peak memory, and the first step's gradients' distance from the eager bf16 step of the
same arrangement on the same weights (a CUDA-graph run that read an overwritten buffer would differ).

    python3 benchmarks/compile_probe.py --out $OUT/compile_probe.json            # one H200, ~6 min
    python3 benchmarks/compile_probe.py --smoke --out /tmp/probe.json             # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_tree

VARIANTS = {
    "static-8x4": {"split": [8] * 4, "mode": "default"},
    "warm-8x4": {"split": [8] * 4, "mode": "default", "cache": "static-8x4"},
    "static-4x8": {"split": [4] * 8, "mode": "default"},
    "static-6655": {"split": [6, 6, 5, 5, 5, 5], "mode": "default"},
    "dynamic-6655": {"split": [6, 6, 5, 5, 5, 5], "mode": "default", "dynamic": True},
    "cudagraphs-4x8": {"split": [4] * 8, "mode": "reduce-overhead", "keep_grads": True},
    "cudagraphs-8x4": {"split": [8] * 4, "mode": "reduce-overhead", "keep_grads": True},
    "cudagraphs-4x8-plain": {"split": [4] * 8, "mode": "reduce-overhead"},
}
GPT = {"n_layer": 16, "n_embd": 1024, "n_head": 16, "block_size": 1024, "vocab": 32768}
TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16, "vocab": 64}


def _one(name: str, spec: dict[str, Any], *, smoke: bool, steps: int) -> dict[str, Any]:
    """Runs in the child process."""
    import torch
    from torch import nn

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "gpt"))
    import torch._functorch.config as fc
    from train import GPT as Model  # type: ignore[import-not-found]
    from train import lm_loss

    fc.activation_memory_budget = 1.0
    device = "cpu" if smoke else "cuda"
    dims = TINY if smoke else GPT
    torch.manual_seed(0)

    class WithLoss(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lm_loss(self.model(x), y)

    with torch.device(device):
        model = WithLoss(Model(dropout=0.0, **dims))
    eager = WithLoss(Model(dropout=0.0, **dims)).to(device)
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, mode=None if spec["mode"] == "default" else spec["mode"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    split = spec["split"]
    gen = torch.Generator().manual_seed(1)
    batches = [[(torch.randint(0, dims["vocab"], (n, dims["block_size"]), generator=gen).to(device),
                 torch.randint(0, dims["vocab"], (n, dims["block_size"]), generator=gen).to(device)) for n in split]
               for _ in range(steps)]
    total = sum(split)
    keep = bool(spec.get("keep_grads"))
    if keep:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)

    def step(module: nn.Module, i: int, *, cuda_graphs: bool) -> float:
        losses = []
        for x, y in batches[i]:
            if spec.get("dynamic") and module is compiled:
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(y, 0)
            if cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = module(x, y)
            (loss * (x.size(0) / total)).backward()
            losses.append(float(loss.detach()))
        return sum(losses) / len(losses)

    out: dict[str, Any] = {"variant": name, **spec}
    times = []
    error = None
    try:
        for i in range(steps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(compiled, i, cuda_graphs=spec["mode"] == "reduce-overhead")
            if i == 0:  # compare the first step's gradients with eager bf16 on the same weights
                grads = [p.grad.detach().float().clone() for p in model.parameters()]
                for p in eager.parameters():
                    p.grad = None
                step(eager, 0, cuda_graphs=False)
                ref = [p.grad.detach().float() for p in eager.parameters()]
                num = sum(float((a - b).pow(2).sum()) for a, b in zip(grads, ref, strict=True))
                den = sum(float(b.pow(2).sum()) for b in ref)
                out["grad_rel_vs_eager_bf16"] = (num / den) ** 0.5 if den else None
            opt.step()
            opt.zero_grad(set_to_none=not keep)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    except Exception as exc:  # the measurement: what fails, in words
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    from torch._dynamo.utils import counters

    out.update({
        "error": error,
        "first_step_s": round(times[0], 2) if times else None,
        "step_ms_median": round(1000 * statistics.median(times[1:]), 1) if len(times) > 1 else None,
        "step_ms_all": [round(1000 * t, 1) for t in times],
        "graphs": int(counters["stats"]["unique_graphs"]),
        "fx_graph_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fx_graph_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None,
    })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, no CUDA-graph variants")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per variant")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache-root", default=None)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_one(args.child, VARIANTS[args.child], smoke=args.smoke, steps=args.steps)))
        return
    root = args.cache_root or tempfile.mkdtemp(prefix="compile-probe-")
    results: list[dict[str, Any]] = []
    for name in args.variants.split(","):
        spec = VARIANTS[name]
        if args.smoke and spec["mode"] == "reduce-overhead":
            continue
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(root, str(spec.get("cache", name))))
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--out", args.out,
               "--steps", str(args.steps), *(["--smoke"] if args.smoke else [])]
        started = time.monotonic()
        done = run_tree(cmd, timeout_s=args.timeout, grace_s=5, env=env)  # the whole tree, compile workers too
        line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        if done.timed_out:
            row = {"variant": name, "error": f"timed out after {args.timeout} s"}
        else:
            row = json.loads(line) if line.startswith("{") else {"variant": name, "error": done.stderr[-600:]}
        row["wall_s"] = round(time.monotonic() - started, 1)
        results.append(row)
        print(json.dumps({k: row.get(k) for k in ("variant", "wall_s", "first_step_s", "step_ms_median", "graphs",
                                                   "fx_graph_hits", "grad_rel_vs_eager_bf16", "error")}), flush=True)
        with open(args.out, "w") as fh:  # partial results kept after every variant
            json.dump({"model": TINY if args.smoke else GPT, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
