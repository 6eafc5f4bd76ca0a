"""``plan.wrap(model, loss=fn)``: the loss computed by the wrapped module, so that a compiled
configuration compiles model and loss as one graph (issue 15, item 4). No process group: fast."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autobalance as ab
from autobalance.runtime import ModelWithLoss


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), y)


def _grads(model: nn.Module, *, loss_in_model: bool, config: ab.BalanceConfig) -> list[torch.Tensor]:
    plan = ab.plan(config=config, device="cpu")
    torch.manual_seed(0)
    wrapped = plan.wrap(model, loss=_loss if loss_in_model else None)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randint(0, 5, (16,), generator=g))
    loader = plan.dataloader(data)
    for micro_batches in plan.steps(loader):
        for x, y in micro_batches:
            with plan.micro_step():
                loss = wrapped(x, y) if loss_in_model else _loss(wrapped(x), y)
                plan.backward(loss)
        grads = [p.grad.clone() for p in model.parameters()]
        break
    return grads


def test_loss_in_model_gives_the_same_gradients_as_the_loss_outside():
    """Fails if the wrapped module computes anything but ``loss(model(x), y)``."""
    config = ab.BalanceConfig(micro_batches=[4], accumulation=2, global_batch=8)
    torch.manual_seed(0)
    outside = _grads(Net(), loss_in_model=False, config=config)
    torch.manual_seed(0)
    inside = _grads(Net(), loss_in_model=True, config=config)
    for a, b in zip(outside, inside, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoints_keep_the_models_own_keys_and_load_into_the_plain_model():
    """Fails if the wrapper's attribute name leaks into state_dict keys (``model.`` prefixes)."""
    net = Net()
    wrapped = ModelWithLoss(net, _loss)
    assert list(wrapped.state_dict()) == list(net.state_dict())
    parent = nn.Sequential(wrapped)  # any parent (DDP included) passes its prefix down
    assert list(parent.state_dict()) == [f"0.{k}" for k in net.state_dict()]
    fresh = Net()
    fresh.load_state_dict(wrapped.state_dict())
    other = ModelWithLoss(Net(), _loss)
    other.load_state_dict(net.state_dict())
    for a, b in zip(other.model.parameters(), net.parameters(), strict=True):
        assert torch.equal(a, b)


def test_compiled_configuration_compiles_the_loss_with_the_model(monkeypatch):
    """With ``loss=`` the graph Dynamo captures contains the loss; without it, it does not.
    Fails if the plan compiles the inner model instead of the model-with-loss."""
    import torch._dynamo

    captured: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs):
        captured.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.register_backend(recording_backend, name="ab_test_recording")
    monkeypatch.setenv("AUTOBALANCE_COMPILE_BACKEND", "ab_test_recording")
    config = ab.BalanceConfig(micro_batches=[4], global_batch=4, compile="default", activation_budget=[0.5])
    for loss_in_model in (False, True):
        captured.clear()
        torch._dynamo.reset()
        _grads(Net(), loss_in_model=loss_in_model, config=config)
        assert captured, "nothing was compiled"
        graph = "\n".join(captured)
        assert ("cross_entropy" in graph) is loss_in_model, graph
    torch._dynamo.reset()
