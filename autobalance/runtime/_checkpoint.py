"""Find a model's repeated blocks and activation-checkpoint a chosen subset of them."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn

from autobalance._errors import ConfigError

__all__ = [
    "BLOCKS_HINT",
    "BlockRun",
    "apply_checkpointing",
    "checkpoint_model",
    "find_blocks",
    "own_checkpointing",
    "without_generation_cache",
]

BLOCKS_HINT = ("name them with plan.wrap(model, blocks=\"path.to.blocks\") (or ab.plan(blocks=...)): a ModuleList "
               "or nn.Sequential of the model's repeated blocks, e.g. 'transformer.h'")
"""How a user names the blocks when discovery finds none (ends every error about blocks)."""

_PRESERVE_RNG_STATE = True
"""Always ``True`` (dropout replays exactly in the recomputation). A private seam, not a setting:
the tests replace it from their own code to build a known-wrong runtime (``tests/bugs``)."""


class BlockRun:
    """Consecutive children of one module that have the same type: the blocks that may be
    checkpointed. Indexing reads and replaces those children in place (``blocks[i] = wrapped``)."""

    def __init__(self, parent: nn.Module | None, names: list[str], path: str) -> None:
        self.parent = parent
        self.names = names
        self.path = path
        """Where the blocks live: the container's dotted path (``""``: the model itself), with
        ``[first..last]`` when they are only part of its children."""

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> nn.Module:
        assert self.parent is not None
        child = self.parent._modules[self.names[index]]
        assert child is not None
        return child

    def __setitem__(self, index: int, module: nn.Module) -> None:
        assert self.parent is not None
        setattr(self.parent, self.names[index], module)

    def __iter__(self) -> Iterator[nn.Module]:
        return (self[i] for i in range(len(self)))


def _composite(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, BlockRun]:
    """The model's repeated blocks: every child of the ``ModuleList``/``nn.Sequential`` at ``path``,
    or the largest run of same-type children anywhere in the module tree.

    Candidates are a ``ModuleList``/``nn.Sequential`` whose children all have one type (any length)
    and, in any module, two or more consecutive children of one type that hold parameters. The
    best has composite blocks (modules with children of their own: a transformer layer rather than
    a pair of ``Linear`` layers), then the most blocks, then is a whole list; ties go to the first
    in the tree. None found: an empty run (``len() == 0``).
    """
    if path is not None:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            raise ConfigError(
                f"blocks={path!r} is not a submodule of {type(model).__name__}; name a ModuleList or "
                "nn.Sequential of repeated blocks such as 'transformer.h'."
            ) from None
        if not isinstance(found, (nn.ModuleList, nn.Sequential)):
            raise ConfigError(
                f"blocks={path!r} is a {type(found).__name__}, not a ModuleList or nn.Sequential; name the "
                "container that holds the repeated blocks."
            )
        return path, BlockRun(found, [n for n, m in found._modules.items() if m is not None], path)
    best: tuple[tuple[bool, int, bool], BlockRun] | None = None
    for name, module in model.named_modules():
        children = [(n, m) for n, m in module._modules.items() if m is not None]
        if not children:
            continue
        is_list = isinstance(module, (nn.ModuleList, nn.Sequential))
        runs: list[list[tuple[str, nn.Module]]] = []
        for child_name, child in children:
            if runs and type(runs[-1][-1][1]) is type(child):
                runs[-1].append((child_name, child))
            else:
                runs.append([(child_name, child)])
        for run in runs:
            whole = is_list and len(run) == len(children)
            if not whole and (len(run) < 2 or not all(_has_parameters(m) for _, m in run)):
                continue
            key = (all(_composite(m) for _, m in run), len(run), whole)
            if best is None or key > best[0]:
                names = [n for n, _ in run]
                where = name if whole else f"{name}[{names[0]}..{names[-1]}]"
                best = (key, BlockRun(module, names, where))
    if best is None:
        return "", BlockRun(None, [], "")
    return best[1].path, best[1]


class _KeepBuffers:
    """Around a recomputation: the block's buffers are put back as they were before it, so a layer
    that updates buffers in its forward (BatchNorm's running statistics, ``num_batches_tracked``)
    updates them once per forward, not again when checkpointing recomputes it."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        # every buffer, not only those whose version counter moves: kernels such as batch_norm's
        # update the running statistics without bumping it
        self._saved = [(b, b.detach().clone()) for b in self.block.buffers()]

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with torch.no_grad():
            for buf, value in self._saved:
                buf.copy_(value)
        self._saved = []


class _Recompute:
    """Around a recomputation: the torch-function modes that were active in the block's forward,
    entered again (the backward's recomputation runs without them; a verification run's
    :class:`~autobalance.runtime._verify.NoDropout` among them), then ``keep`` (:class:`_KeepBuffers`)."""

    def __init__(self, modes: list[Any], keep: _KeepBuffers | None) -> None:
        self.modes = modes
        self.keep = keep
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> None:
        from torch.overrides import _get_current_function_mode_stack

        active = {id(m) for m in _get_current_function_mode_stack()}
        for mode in self.modes:
            if id(mode) not in active:
                self._stack.enter_context(mode)
        if self.keep is not None:
            self._stack.enter_context(self.keep)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stack.close()


def _keep_buffers(block: nn.Module) -> _KeepBuffers | None:
    """A private seam, not a setting: the tests replace it from their own code to build a known-wrong
    runtime (``tests/bugs``, ``no-keep-buffers``): what the recomputation of ``block`` runs inside to
    keep its buffers (``None``: nothing)."""
    return _KeepBuffers(block) if next(block.buffers(), None) is not None else None


def _context_fn(block: nn.Module) -> Any:
    """The checkpoint's ``context_fn`` for ``block``: its recomputation runs inside :class:`_Recompute`
    (``None``: PyTorch's default, no contexts)."""

    def contexts() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        from torch.overrides import _get_current_function_mode_stack

        modes = list(_get_current_function_mode_stack())
        keep = _keep_buffers(block)
        if not modes and keep is None:  # an ordinary training step: nothing to replay
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), _Recompute(modes, keep)

    return contexts


def own_checkpointing(model: nn.Module) -> list[str]:
    """The modules of ``model`` that checkpoint by themselves (``gradient_checkpointing = True``, the
    flag Hugging Face models set on ``gradient_checkpointing_enable()``), by name."""
    # the module's own attribute: a checkpoint wrapper forwards attribute reads to the block it wraps
    return [name or type(model).__name__ for name, module in model.named_modules()
            if vars(module).get("gradient_checkpointing") is True]


def checkpoint_model(model: nn.Module, blocks: BlockRun | nn.ModuleList | nn.Sequential,
                     checkpoint: list[list[int]], rank: int) -> None:
    """This rank's part of the configuration's checkpointing (``checkpoint``: every rank's blocks):
    a warning when the model checkpoints on its own (:func:`_warn_of_own_checkpointing`, before the
    wrappers, so it names the modules the user knows), this rank's blocks wrapped
    (:func:`apply_checkpointing`), and the generation cache off when any rank checkpoints
    (:func:`without_generation_cache`)."""
    _warn_of_own_checkpointing(model)
    apply_checkpointing(blocks, checkpoint[rank])
    without_generation_cache(model, checkpoint)


def _warn_of_own_checkpointing(model: nn.Module) -> None:
    """Warn when the model checkpoints its own blocks: the configuration's per-rank checkpointing then
    recomputes on top of it, and what a study chooses for it changes nothing but time. Tune and
    production still agree (both run the model's own), so this is a warning, not an error."""
    names = own_checkpointing(model)
    if not names:
        return
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    warnings.warn(
        f"autobalance: {names[0]}{more} checkpoint their own blocks (gradient_checkpointing=True): the configuration's "
        "per-rank checkpointing then recomputes on top, and what it chooses does not change memory. Turn the "
        "model's own off (model.gradient_checkpointing_disable()) and give the script's default to "
        "autobalance.plan(checkpoint=N).", stacklevel=3)


def without_generation_cache(model: nn.Module, checkpoint: list[list[int]]) -> bool:
    """Switch off the generation cache (``config.use_cache`` of the model or of any module inside it,
    such as a Hugging Face model inside a ``LightningModule``) when any rank checkpoints a block;
    returns whether it did.

    A checkpointed block is run twice, and a block that appends this step's keys and values to a
    cache passed in (a Hugging Face model whose config says ``use_cache``; transformers 4.x builds
    that cache in training too) appends them again when it is recomputed: the recomputation then
    sees twice the sequence and torch stops it (``CheckpointError``, other metadata). transformers
    switches the cache off itself under its own gradient checkpointing; a cache serves generation,
    never the training step, so nothing the step computes changes. Every rank does it when any
    rank checkpoints, so the ranks' models stay alike. Duck-typed: no framework is imported."""
    if not any(checkpoint):
        return False
    switched = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False  # type: ignore[union-attr]
            switched = True
    return switched


def apply_checkpointing(blocks: BlockRun | nn.ModuleList | nn.Sequential, indices: list[int]) -> None:
    """Wrap ``blocks[i]`` for each index in PyTorch's non-reentrant checkpoint wrapper.

    Non-reentrant checkpointing with ``preserve_rng_state=True`` replays dropout exactly; the
    wrapper strips its prefix from ``state_dict`` keys, so saved checkpoints stay compatible. A
    block with buffers gets its buffers restored after the recomputation (see :class:`_KeepBuffers`).
    """
    if not indices:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        checkpoint_wrapper,
    )

    for index in indices:
        if index >= len(blocks):
            raise ConfigError(
                f"checkpoint index {index} is out of range for {len(blocks)} blocks; use 0..{len(blocks) - 1}"
                + ("." if len(blocks) else f", or {BLOCKS_HINT}.")
            )
        block = blocks[index]
        if isinstance(block, CheckpointWrapper):
            continue
        kwargs: dict[str, Any] = {}
        context = _context_fn(block)
        if context is not None:
            kwargs["context_fn"] = context
        blocks[index] = checkpoint_wrapper(
            block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=_PRESERVE_RNG_STATE, **kwargs
        )
