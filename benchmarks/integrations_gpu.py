"""Issue 35 on one GPU: each integration (Lightning, HF Trainer, Accelerate) at world size 1 applies a
configuration's dtype and compile budget to a GPT-2 built from its config (no download); step time
and peak memory are measured, eager and compiled.

    python benchmarks/integrations_gpu.py --out "$OUT/integrations_gpu.json"
    python benchmarks/integrations_gpu.py --smoke --out /tmp/integrations_smoke.json   # CPU, seconds

Each (integration, configuration) runs in its own process (fresh compile state and memory peak), with a
timeout. Needs torch, lightning, transformers and accelerate; not optuna. Writes one JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import run_tree  # noqa: E402

INTEGRATIONS = ("lightning", "hf", "accelerate")


def model_size(smoke: bool) -> dict[str, int]:
    if smoke:
        return {"n_layer": 2, "n_embd": 64, "n_head": 4, "length": 32, "vocab": 256, "micro_batch": 4}
    return {"n_layer": 12, "n_embd": 768, "n_head": 12, "length": 512, "vocab": 8192, "micro_batch": 8}


def configs(smoke: bool, budget: float) -> list[dict[str, Any]]:
    """The configurations measured per integration: eager in the dtype, and compiled with the budget."""
    dtype = "bf16"
    out = [{"name": f"{dtype} eager", "dtype": dtype, "compile": "off", "activation_budget": None}]
    if not smoke:
        out.append({"name": f"{dtype} compiled budget {budget}", "dtype": dtype, "compile": "default",
                    "activation_budget": [budget]})
    return out


# --------------------------------------------------------------------------- one child process
def build_model(size: dict[str, int]) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=size["vocab"], n_positions=size["length"], n_embd=size["n_embd"],
                     n_layer=size["n_layer"], n_head=size["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class Tokens:
    def __init__(self, n: int, length: int, vocab: int) -> None:
        import torch

        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimer:
    """Optimizer-step post hook: wall time of each step (synchronised on CUDA)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def __call__(self, *_: Any) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def child(integration: str, config: dict[str, Any], size: dict[str, int], steps: int) -> dict[str, Any]:
    import torch

    import autobalance as ab
    from autobalance._config import BalanceConfig

    cuda = torch.cuda.is_available()
    mb = size["micro_batch"]
    balance = BalanceConfig(micro_batches=[mb], accumulation=1, global_batch=mb, checkpoint=[[]],
                            dtype=config["dtype"] if cuda or config["dtype"] != "fp16" else "fp32",
                            compile=config["compile"], activation_budget=config["activation_budget"])
    plan = ab.plan(config=balance, device="cuda" if cuda else "cpu")
    data = Tokens(mb * (steps + 1), size["length"], size["vocab"])
    model = build_model(size)
    timer = StepTimer()
    matmul: list[str] = []  # the dtype a block's first matmul ran in (eager only: a hook would break the graph)
    if config["compile"] == "off":
        model.transformer.h[0].mlp.c_fc.register_forward_hook(
            lambda _m, _i, out: matmul.append(str(out.dtype).removeprefix("torch.")) if not matmul else None)
    if integration == "lightning":
        run_lightning(plan, model, data, timer, steps)
    elif integration == "hf":
        run_hf(plan, model, data, timer, steps)
    else:
        run_accelerate(plan, model, data, timer, steps)
    warm = timer.times[2:] if len(timer.times) > 4 else timer.times  # the first steps compile / warm up
    compiled = plan.compile_state
    return {
        "integration": integration,
        "configuration": config["name"],
        "applied": {"dtype": plan.config.dtype, "compile": plan.config.compile,
                    "activation_budget_used": compiled.budget_used if compiled is not None else None},
        "matmul_dtype": matmul[0] if matmul else None,
        "first_step_s": timer.times[0] if timer.times else None,
        "step_times_s": timer.times,
        "median_step_s": statistics.median(warm) if warm else None,
        "samples_per_s": (mb / statistics.median(warm)) if warm else None,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
    }


def run_lightning(plan: Any, model: Any, data: Any, timer: StepTimer, steps: int) -> None:
    import lightning.pytorch as pl
    import torch

    from autobalance.integrations.lightning import BalanceStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = model

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.gpt(input_ids=input_ids, labels=labels).loss

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch["input_ids"], batch["labels"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-4)
            opt.register_step_post_hook(timer)
            return opt

    strategy = BalanceStrategy(plan)
    trainer = pl.Trainer(accelerator="auto", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=1))  # type: ignore[arg-type]


def run_hf(plan: Any, model: Any, data: Any, timer: StepTimer, steps: int) -> None:
    import torch
    from transformers import TrainingArguments

    from autobalance.integrations.hf import BalanceTrainer

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.register_step_post_hook(timer)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=steps, report_to="none",
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                 use_cpu=not torch.cuda.is_available(), lr_scheduler_type="constant")
        BalanceTrainer(model=model, args=args, train_dataset=data, optimizers=(opt, None), plan=plan).train()


def run_accelerate(plan: Any, model: Any, data: Any, timer: StepTimer, steps: int) -> None:
    import torch
    from accelerate import Accelerator

    from autobalance.integrations.accelerate import AccelerateBalance

    balance = AccelerateBalance(plan)
    accelerator = Accelerator(**balance.accelerator_kwargs())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.register_step_post_hook(timer)
    wrapped, optimizer, loader = balance.prepare(accelerator, model, opt, data)
    for done, batch in enumerate(loader, start=1):
        with accelerator.accumulate(wrapped), balance.micro_step():
            balance.backward(wrapped(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        if done >= steps:
            break


# --------------------------------------------------------------------------- the parent
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU (seconds), eager only")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 20, smoke 4)")
    parser.add_argument("--budget", type=float, default=0.5, help="the compiled configuration's activation budget")
    parser.add_argument("--only", default=",".join(INTEGRATIONS), help="integrations, comma-separated")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = model_size(args.smoke)
    steps = args.steps or (4 if args.smoke else 20)
    if args.child:
        spec = json.loads(args.child)
        result = child(spec["integration"], spec["config"], size, steps)
        Path(args.out).write_text(json.dumps(result))
        return
    import torch

    runs: list[dict[str, Any]] = []
    for integration in args.only.split(","):
        for config in configs(args.smoke, args.budget):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                path = tmp.name
            spec = json.dumps({"integration": integration, "config": config})
            cmd = [sys.executable, __file__, "--child", spec, "--out", path, "--steps", str(steps)]
            if args.smoke:
                cmd.append("--smoke")
            started = time.perf_counter()
            try:  # the whole tree ends with the run (Inductor's compile workers too)
                proc = run_tree(cmd, timeout_s=args.timeout, grace_s=5, env={**os.environ, "PYTHONPATH": str(REPO)})
                ok = proc.returncode == 0 and os.path.getsize(path) > 0
                if ok:
                    result = json.loads(Path(path).read_text())
                else:
                    error = f"timed out after {args.timeout} s" if proc.timed_out else proc.stderr[-3000:]
                    result = {"integration": integration, "configuration": config["name"], "error": error}
            finally:
                os.unlink(path)
            result["wall_s"] = time.perf_counter() - started
            runs.append(result)
            print(json.dumps({k: result.get(k) for k in ("integration", "configuration", "matmul_dtype", "median_step_s",
                                                          "peak_allocated_bytes", "error")})[:400], flush=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "model": size,
        "steps": steps,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    failed = [r for r in runs if "error" in r]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
