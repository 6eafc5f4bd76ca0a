"""Integrations with the frameworks that own the training loop: one module per framework, each an
optional extra, each importing its framework only when the module itself is imported.

- :mod:`autobalance.integrations.lightning` (``pip install -e '.[lightning]'``):
  ``BalanceStrategy``, a Lightning DDP strategy;
- :mod:`autobalance.integrations.hf` (``pip install -e '.[hf]'``): ``BalanceTrainer``, a
  Hugging Face ``Trainer``;
- :mod:`autobalance.integrations.accelerate` (``pip install -e '.[accelerate]'``):
  ``AccelerateBalance``, ``prepare`` and ``backward`` beside an ``Accelerator``'s.

Each applies a configuration through :class:`autobalance.runtime.FrameworkLoop`: this rank's
micro-batches through the framework's training loader, its gradient accumulation, checkpointing of
the chosen blocks, the dtype through the framework's precision setting, DDP buckets, compile; and the
ranks weighted inside DDP's all-reduce (:func:`autobalance.runtime.weighted_sum_hook`), so an
uneven split gives the update of one process on the whole global batch although the framework
calls ``backward`` itself. A loss that is a mean over tokens (padded sequences) stays the mean over
the whole step's tokens: the ``Trainer`` keeps transformers' ``num_items_in_batch``; Lightning's
``training_step`` returns ``{"loss": loss, "count": n_tokens}``, Accelerate's loop calls
``balance.backward(loss, count=n_tokens)``. This package imports no framework (the core never does).
"""

from __future__ import annotations

__all__: list[str] = []
