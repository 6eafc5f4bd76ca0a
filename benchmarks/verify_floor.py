"""How far apart are two *correct* arrangements of one global batch, on this device? (issue 29)

Verify's part 1 compares a tuned configuration's fp32 step with the script's own. Its tolerance must
sit above the device's rounding for this model and below a wrong loss weighting. This measures, for
the GPT of ``studies/gpt-1gpu.toml`` (one optimizer step of global batch 32, per-sample-mean loss
weighted by each micro-batch's share, the loss outside the model in fp32, as nanoGPT does):

- the gradient and updated-parameter error of arrangements 4x8, 16x2, 32x1 and 6,6,5,5,5,5 against
  8x4 (the script's own), in fp32 with TF32 off and on;
- candidate *floors*, measured without changing any loss weighting: 8x4 again (determinism), 8x4
  with the samples of each micro-batch in reverse order (same shapes, other summation order), and
  the distance of 8x4 from an fp64 run of the same step;
- what a systematic reweighting of 1e-3 and a sum-reduced loss look like, for the margin;
- bf16 runs against the fp32 reference (verify's part 2).

    PYTHONPATH=. python3 benchmarks/verify_floor.py --out benchmarks/<date>-h200/verify_floor.json

Small on CPU: ``--n-layer 2 --n-embd 64 --n-head 4 --block-size 32 --vocab 256 --device cpu``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time
from typing import Any

import torch
import torch.nn.functional as F


def load_gpt() -> Any:
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt", "train.py")
    spec = importlib.util.spec_from_file_location("gpt_example", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b, strict=True))
    den = sum(float(y.double().pow(2).sum()) for y in b)
    return math.sqrt(num / den) if den else 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="")
    args = p.parse_args()
    gpt = load_gpt()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device(dev):
        model = gpt.GPT(vocab=args.vocab, block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd,
                        n_head=args.n_head, dropout=0.0)
    model.eval()  # no dropout
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters()]
    g = torch.Generator().manual_seed(1234)
    gb = args.global_batch
    data = torch.randint(0, args.vocab, (gb, args.block_size + 1), generator=g).to(dev)
    x_all, y_all = data[:, :-1], data[:, 1:]

    def step(sizes: list[int], *, dtype: str = "fp32", tf32: bool = False, reverse: bool = False,
             weight_err: float = 0.0, sum_loss: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        model.load_state_dict(init)
        if dtype == "fp64":
            model.double()
        for q in model.parameters():
            q.grad = None
        t0 = time.perf_counter()
        start = 0
        for i, b in enumerate(sizes):
            idx = torch.arange(start, start + b, device=dev)
            if reverse:
                idx = idx.flip(0)
            start += b
            x, y = x_all[idx], y_all[idx]
            ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast(dev.type, enabled=False)
            with ctx:
                logits = model(x)
            if dtype == "fp64":
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), reduction="sum" if sum_loss else "mean")
            else:
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.reshape(-1),
                                       reduction="sum" if sum_loss else "mean")
            w = b / gb  # autobalance's weight of a micro-batch (its share of the global batch)
            if i == 0:
                w *= 1.0 + weight_err
            (loss * w).backward()
        grads = [q.grad.detach().double().clone() if dtype == "fp64" else q.grad.detach().float().clone()
                 for q in model.parameters()]
        # one AdamW step, functional (first step: m = (1-b1) g, v = (1-b2) g^2, bias-corrected)
        lr, eps, wd = 3e-4, 1e-8, 0.01
        new = []
        with torch.no_grad():
            for q, gr in zip(model.parameters(), grads, strict=True):
                upd = gr / (gr.abs() + eps)
                new.append((q.detach() * (1 - lr * wd) - lr * upd).clone())
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if dtype == "fp64":
            model.float()
        return grads, new, wall

    out: dict[str, Any] = {"model": vars(args), "params": sum(q.numel() for q in params),
                           "torch": torch.__version__,
                           "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "rows": []}
    own = [gb // 4] * 4
    arrangements = {"4x8": [gb // 8] * 8, "16x2": [gb // 2] * 2, "32x1": [gb], "6,6,5,5,5,5": None}
    sizes6 = [6, 6, 5, 5, 5, 5] if gb == 32 else [gb // 6 + (1 if i < gb % 6 else 0) for i in range(6)]
    arrangements["6,6,5,5,5,5"] = sizes6
    ref64_g, ref64_p, wall = step(own, dtype="fp64")
    out["fp64_wall_s"] = round(wall, 3)

    def row(name: str, grads: list[torch.Tensor], new: list[torch.Tensor], ref: tuple[list[torch.Tensor], list[torch.Tensor]],
            wall: float, **extra: Any) -> None:
        r = {"run": name, "grad_rel": rel(grads, ref[0]), "param_rel": rel(new, ref[1]),
             "grad_rel_vs_fp64": rel(grads, ref64_g), "param_rel_vs_fp64": rel(new, ref64_p), "wall_s": round(wall, 3),
             **extra}
        out["rows"].append(r)
        print(json.dumps(r), flush=True)

    for tf32 in (False, True):
        base_g, base_p, wall = step(own, tf32=tf32)
        ref = (base_g, base_p)
        row("8x4 (reference)", base_g, base_p, ref, wall, tf32=tf32)
        g2, p2, wall = step(own, tf32=tf32)
        row("8x4 again", g2, p2, ref, wall, tf32=tf32, kind="floor")
        g2, p2, wall = step(own, tf32=tf32, reverse=True)
        row("8x4 reversed within micro-batches", g2, p2, ref, wall, tf32=tf32, kind="floor")
        for name, sizes in arrangements.items():
            g2, p2, wall = step(sizes, tf32=tf32)
            row(name, g2, p2, ref, wall, tf32=tf32, kind="correct")
        g2, p2, wall = step(arrangements["16x2"], tf32=tf32, weight_err=1e-3)
        row("16x2, first micro-batch weighted 1+1e-3", g2, p2, ref, wall, tf32=tf32, kind="wrong")
        g2, p2, wall = step([gb // 2] * 2, tf32=tf32, sum_loss=True)
        gs, ps, _ = step(own, tf32=tf32, sum_loss=True)
        row("16x2 sum-reduced loss vs 8x4 sum-reduced", g2, p2, (gs, ps), wall, tf32=tf32, kind="wrong")
        del gs, ps
        for name, sizes in (("bf16 8x4", own), ("bf16 16x2", arrangements["16x2"])):
            g2, p2, wall = step(sizes, dtype="bf16", tf32=tf32)
            row(name, g2, p2, ref, wall, tf32=tf32, kind="bf16")
        del base_g, base_p, ref
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
