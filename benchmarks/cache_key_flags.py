"""Issue 30: are the process-wide precision flags, and verify's torch-function mode, part of
Inductor's FX graph cache key? (Why a verification run that inherited full-precision flags from the
run before it recompiled a graph the study had already compiled.)

Four fresh processes share one cache directory and compile the same small model:
``base`` (fills the cache), ``base`` again (hits), ``flag`` (reduced-precision reductions off, as
verification's fp32 runs set them: misses if the flags are in the key), ``mode`` (the graph run
under ``autobalance.runtime._verify.NoDropout``: hits if the mode is not in the key).

    python3 benchmarks/cache_key_flags.py          # CPU, about a minute
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = """
import sys, torch
from torch import nn
from torch._dynamo.utils import counters
variant = sys.argv[1]
if variant == "flag":
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
model = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)))
x = torch.randn(4, 8)
if variant == "mode":
    from autobalance.runtime._verify import NoDropout
    with NoDropout():
        model(x).sum().backward()
else:
    model(x).sum().backward()
print(variant, "hits", counters["inductor"]["fxgraph_cache_hit"], "misses", counters["inductor"]["fxgraph_cache_miss"])
"""


def main() -> None:
    cache = tempfile.mkdtemp(prefix="cache-key-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    for variant in ("base", "base", "flag", "mode"):
        out = subprocess.run([sys.executable, "-c", CHILD, variant], env=env, capture_output=True, text=True,
                             timeout=300)
        print(out.stdout.strip() or out.stderr[-500:], flush=True)


if __name__ == "__main__":
    main()
