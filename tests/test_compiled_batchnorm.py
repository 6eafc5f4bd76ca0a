"""A BatchNorm model compiled with a small activation budget (issue 16): the recomputation the
min-cut partitioner chooses must not update the running statistics a second time. In process, one
rank, CPU; the backend is ``aot_eager_decomp_partition`` (AOTAutograd's min-cut partitioner, the one
that reads ``activation_memory_budget``, without Inductor's code generation)."""

from __future__ import annotations

import torch
from torch import nn

import autobalance as ab


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.squeeze(-1) - y).square().mean()


def _one_step(config: ab.BalanceConfig) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = NormNet()
    plan = ab.plan(config=config, device="cpu")
    wrapped = plan.wrap(model, loss=_loss)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, generator=g))
    for micro_batches in plan.steps(plan.dataloader(data)):
        for x, y in micro_batches:
            with plan.micro_step():
                plan.backward(wrapped(x, y))
        grads = [p.grad.detach().clone() for p in model.parameters()]
        break
    return model, grads


def test_a_compiled_budget_updates_batchnorm_statistics_once_per_micro_step(monkeypatch):
    """Fails if a compiled recomputation (budget 0.05: the partitioner recomputes what it can in the
    backward) updates BatchNorm's running statistics again: ``num_batches_tracked`` would count more
    than one update per micro-step and the running statistics would differ from eager's."""
    import torch._dynamo

    monkeypatch.setenv("AUTOBALANCE_COMPILE_BACKEND", "aot_eager_decomp_partition")
    eager_cfg = ab.BalanceConfig(micro_batches=[16], accumulation=2, global_batch=32)
    compiled_cfg = ab.BalanceConfig(micro_batches=[16], accumulation=2, global_batch=32, compile="default",
                                    activation_budget=[0.05])
    eager, eager_grads = _one_step(eager_cfg)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    try:
        compiled, compiled_grads = _one_step(compiled_cfg)
        assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    finally:
        torch._dynamo.reset()
    for e, c in zip(eager.modules(), compiled.modules(), strict=True):
        if isinstance(e, nn.BatchNorm1d):
            assert int(c.num_batches_tracked) == int(e.num_batches_tracked) == 2  # two micro-steps, once each
            torch.testing.assert_close(c.running_mean, e.running_mean, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(c.running_var, e.running_var, rtol=1e-6, atol=1e-7)
    flat = [torch.cat([t.flatten() for t in grads]) for grads in (eager_grads, compiled_grads)]
    assert float((flat[1] - flat[0]).norm() / flat[0].norm()) <= 1e-6
