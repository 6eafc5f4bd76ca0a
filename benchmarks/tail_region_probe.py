"""Can Dynamo compile "the rest of the forward after the last block" (final norm, head, loss) as one
region while the blocks are compiled on their own? (issue 40's tail region)

A GPT-shaped model whose ``forward`` loops over its blocks (``for block in self.h: x = block(x)``, as
nanoGPT and most scripts write it) is compiled whole with each block made opaque to the outer trace
(its own compiled graph behind ``torch._dynamo.disable``), with and without
``torch._dynamo.config.nested_graph_breaks``. Printed: the graphs the outer compile captured and the
operations in each. A tail region would show one graph holding ``layer_norm``, ``linear`` and
``cross_entropy``.

    python benchmarks/tail_region_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class GPT(nn.Module):
    def __init__(self, d: int = 32, n: int = 3, vocab: int = 50) -> None:
        super().__init__()
        self.emb, self.h = nn.Embedding(vocab, d), nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


class WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


class Opaque(nn.Module):
    """A block compiled on its own, a graph break for the outer trace."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = torch.compile(inner, backend="aot_eager")

    @torch._dynamo.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def probe(nested: bool) -> list[list[str]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT()
    for i, block in enumerate(model.h):
        model.h[i] = Opaque(block)
    graphs: list[list[str]] = []

    def backend(gm: torch.fx.GraphModule, example: object) -> object:
        graphs.append([str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
                       if n.op in ("call_function", "call_module", "call_method")])
        return gm.forward

    with torch._dynamo.config.patch(nested_graph_breaks=nested):
        outer = torch.compile(WithLoss(model), backend=backend)
        x, y = torch.randint(0, 50, (4, 8)), torch.randint(0, 50, (4, 8))
        outer(x, y).backward()
    return graphs


def main() -> None:
    print(f"torch {torch.__version__}")
    for nested in (False, True):
        graphs = probe(nested)
        print(f"nested_graph_breaks={nested}: {len(graphs)} outer graph(s)")
        for ops in graphs:
            print("   ", ", ".join(ops))


if __name__ == "__main__":
    main()
