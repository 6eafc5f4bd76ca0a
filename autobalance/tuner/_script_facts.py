"""What the baseline trial's report says about the script that shapes the study, in words: its
repeated blocks (none found: checkpointing is not searched), batch-dependent layers (the split
stays the script's own), a dataset smaller than one global batch (every step is a partial step).

The study prints these lines first, before any other trial runs."""

from __future__ import annotations

from typing import Any

from autobalance._config import BalanceConfig
from autobalance.protocol import RankReport, StudyAttr
from autobalance.tuner.search import SearchSpace

__all__ = ["ATTR_SCRIPT_FACTS", "batch_dependent_layers", "keep_split", "name_blocks", "script_facts", "summary_facts"]

ATTR_SCRIPT_FACTS = StudyAttr.SCRIPT_FACTS
"""Study attribute: the lines of :func:`script_facts` for the baseline (shown again in the summary)."""


def batch_dependent_layers(report: RankReport) -> list[str]:
    """``"path (Type)"`` of the batch-dependent layers the baseline found (BatchNorm and its kind,
    modules whose forward wrote their buffers)."""
    layers = (report.model or {}).get("batch_dependent") or []
    return [str(x) for x in layers]


def _shown(layers: list[str]) -> str:
    return ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")


def keep_split(space: SearchSpace, *, report: RankReport, own: BalanceConfig, allow: bool) -> bool:
    """Restrict ``space`` to the split and accumulation of ``own`` (the script's own configuration:
    its micro-batch per rank, even or not) when the model has batch-dependent layers and changing
    their step is not allowed; returns whether it did."""
    if allow or not batch_dependent_layers(report):
        return False
    space.keep_split(own)
    return True


_NAME_BLOCKS = {
    "lightning": "BalanceStrategy(..., blocks={})",
    "hf": "BalanceTrainer(..., blocks={})",
    "accelerate": "balance.prepare(accelerator, model, optimizer, dataset, blocks={})",
}
"""How a script of each integration names its blocks (``model_info["framework"]`` in the rank report)."""


def name_blocks(model: dict[str, Any], path: str) -> str:
    """The call that names the blocks at ``path`` in this script: ``plan.wrap(model, blocks=...)``, or
    the integration's own ``blocks=`` when a framework owns the loop (it never calls ``plan.wrap``)."""
    return _NAME_BLOCKS.get(str(model.get("framework") or ""), "plan.wrap(model, blocks={})").format(path)


def script_facts(report: RankReport, *, kept_split: bool, allow: bool, split: str) -> list[str]:
    """One line per fact (see the module doc); ``split``: the script's split in words."""
    lines = []
    model = report.model or {}
    if int(model.get("num_blocks") or 0) == 0:
        lines.append("No repeated blocks found in the model (no ModuleList or nn.Sequential of same-type blocks): "
                     "activation checkpointing is not searched. Name the blocks with "
                     + name_blocks(model, '"path.to.blocks"') + " to search it.")
    else:
        lines.append(f"Blocks: {model.get('num_blocks')} at '{model.get('blocks_path') or '(the model)'}' "
                     f"(name others with {name_blocks(model, '...')}).")
    layers = batch_dependent_layers(report)
    if layers and kept_split:
        lines.append(f"Batch-dependent layers ({_shown(layers)}): their train-mode step depends on which samples "
                     f"share a micro-batch, so the split and accumulation stay the script's own ({split}); "
                     "checkpointing, dtype, buckets and compile are searched. Pass --allow-batch-dependent to "
                     "search splits anyway (verified in eval mode).")
    elif layers and allow:
        lines.append(f"Batch-dependent layers ({_shown(layers)}): splits are searched (--allow-batch-dependent) and "
                     "verified in eval mode; their batch statistics change with the split.")
    data = report.data or {}
    samples, global_batch = data.get("samples"), data.get("global_batch")
    if isinstance(samples, int) and isinstance(global_batch, int) and samples < global_batch:
        lines.append(f"The dataset has {samples} samples, fewer than one global batch ({global_batch}): every step "
                     f"is a partial step of at most {samples} samples, and samples/s counts the samples really "
                     "used. Give the script more data (or a smaller --global-batch) to tune full steps.")
    return lines


def summary_facts(study_attrs: dict[str, Any]) -> list[str]:
    """The facts the study's summary repeats: what limits the search (no blocks, a kept split, a
    dataset smaller than one global batch); the line naming the blocks found is said once, at the start."""
    facts = study_attrs.get(ATTR_SCRIPT_FACTS) or []
    return [str(line) for line in facts if not str(line).startswith("Blocks: ")]
