"""Issue 33: how much slower is the GPT scenario's step on part of a GPU's SMs? (the emulated slow GPU
of a mixed machine, so that the two-GPU proof later is a single run)

Each mode runs in its own process (a green context that fails to start leaves the other results):
``full`` (all SMs, no green context) and ``sms=<N>`` (the work on a ``torch.cuda.green_contexts``
green context of N SMs, rounded down to a multiple of 8; ``--fractions`` of the device's SMs). The
model is ``examples/gpt/train.py``'s GPT at the size of ``studies/gpt-1gpu.toml`` (16 x 1024, 16
heads, 1024 tokens, 32k vocabulary), bf16 autocast, AdamW, micro-batch 8 x 4 accumulation (the
scenario's own global batch of 32), eager. Each mode: ``--warmup`` steps, then ``--steps`` timed
optimizer steps (CUDA events around each step, synchronised), median and spread.

What a green context emulates: a GPU with fewer SMs and the same memory, clocks, memory bandwidth
and interconnect (a smaller part of the same generation). It does not emulate a different
architecture's kernels, a slower memory system or another memory capacity (use ``--memory-cap-gib``
for that).

GPU (the lead's command; torch 2.11, numpy):
    python benchmarks/green_context.py --out "$OUT/green_context.json"
CPU check of the script itself (tiny model, no green context):
    python benchmarks/green_context.py --smoke --out /tmp/green_context.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import run_tree  # noqa: E402

GPT_SIZE = {"n_layer": 16, "n_embd": 1024, "n_head": 16, "block_size": 1024, "vocab": 32768}
SMOKE_SIZE = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16, "vocab": 64}


def _gpt_module() -> Any:
    spec = importlib.util.spec_from_file_location("gpt_train", REPO / "examples" / "gpt" / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Green:
    """Enter and leave a green context of ``num_sms`` SMs (torch 2.11's API, with the names of the
    versions around it), and the stream to run on inside it when the API has one."""

    def __init__(self, num_sms: int, device: int) -> None:
        import torch
        from torch.cuda import green_contexts as gc

        try:
            self.ctx = gc.GreenContext.create(num_sms=num_sms, device_id=device)
        except TypeError:
            self.ctx = gc.GreenContext.create(num_sms, device)
        self.enter = getattr(self.ctx, "set_context", None) or self.ctx.make_current
        self.leave = getattr(self.ctx, "pop_context", None) or self.ctx.pop_current
        self.stream = self.ctx.Stream() if hasattr(self.ctx, "Stream") else None
        self.api = [name for name in ("create", "set_context", "pop_context", "make_current", "Stream")
                    if hasattr(self.ctx, name) or hasattr(gc.GreenContext, name)]
        self.torch = torch


def one_mode(args: argparse.Namespace) -> dict[str, Any]:
    """One mode, in this process: build, warm up, time the steps."""
    import torch

    gpt = _gpt_module()
    cuda = not args.smoke and torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    size = SMOKE_SIZE if args.smoke else GPT_SIZE
    out: dict[str, Any] = {"mode": "full" if args.sms == 0 else f"sms={args.sms}", "device": str(device),
                           "size": size, "micro_batch": args.micro_batch, "accumulation": args.accumulation,
                           "dtype": "bf16", "torch": torch.__version__}
    green = None
    if cuda:
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, total_sms=props.multi_processor_count)
        if args.sms:
            green = _Green(args.sms, 0)
            out["green_api"] = green.api
            green.enter()
    stream = green.stream if green is not None else None
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
    with ctx:
        torch.manual_seed(0)
        model = gpt.GPT(dropout=0.0, **size).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randint(0, size["vocab"], (args.micro_batch, size["block_size"]), generator=g).to(device)
        y = torch.randint(0, size["vocab"], (args.micro_batch, size["block_size"]), generator=g).to(device)

        def step() -> None:
            for _ in range(args.accumulation):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = gpt.lm_loss(model(x), y) / args.accumulation
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times: list[float] = []
        for i in range(args.warmup + args.steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                step()
                ms = 1000 * (time.perf_counter() - t0)
            if i >= args.warmup:
                times.append(ms)
        if cuda:
            out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    if green is not None:
        green.leave()
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
    out.update(step_ms=round(statistics.median(times), 3), iqr_ms=round(q[2] - q[0], 3),
               steps_ms=[round(t, 3) for t in times],
               samples_per_s=round(args.micro_batch * args.accumulation / (statistics.median(times) / 1000), 2))
    return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, no green context (checks the script)")
    p.add_argument("--fractions", default="0.5", help="fractions of the SMs to emulate, comma-separated")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout-s", type=float, default=240, help="per mode")
    p.add_argument("--sms", type=int, default=0, help=argparse.SUPPRESS)  # one mode, in a child process
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.micro_batch, args.accumulation, args.warmup, args.steps = 2, 2, 1, 3
    if args.child:
        Path(args.out).write_text(json.dumps(one_mode(args)))
        return
    import torch

    sms_list = [0]
    if not args.smoke and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).multi_processor_count
        sms_list += [max(8, int(total * float(f)) // 8 * 8) for f in args.fractions.split(",") if float(f) < 1]
    results: list[dict[str, Any]] = []
    for sms in sms_list:
        part = Path(f"{args.out}.mode{sms}.json")
        cmd = [sys.executable, __file__, "--child", "--out", str(part), "--sms", str(sms),
               "--micro-batch", str(args.micro_batch), "--accumulation", str(args.accumulation),
               "--warmup", str(args.warmup), "--steps", str(args.steps), *(["--smoke"] if args.smoke else [])]
        proc = run_tree(cmd, timeout_s=args.timeout_s, grace_s=5, cwd=REPO)
        if proc.returncode == 0 and part.exists():
            results.append(json.loads(part.read_text()))
        else:
            error = f"timed out after {args.timeout_s} s" if proc.timed_out else proc.stderr[-3000:]
            results.append({"mode": f"sms={sms}" if sms else "full", "error": error})
        if part.exists():
            os.remove(part)
        print(json.dumps(results[-1])[:400], flush=True)
    full = next((r for r in results if r.get("mode") == "full" and "step_ms" in r), None)
    for r in results:
        if full is not None and "step_ms" in r:
            r["slowdown_vs_full"] = round(r["step_ms"] / full["step_ms"], 3)
    summary = {"benchmark": "green_context", "scenario": "studies/gpt-1gpu.toml's GPT, bf16, eager",
               "smoke": args.smoke, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({r.get("mode"): r.get("slowdown_vs_full", r.get("error", "")[:200]) for r in results}))


if __name__ == "__main__":
    main()
