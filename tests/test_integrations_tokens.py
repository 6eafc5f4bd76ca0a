"""Issue 42: the integrations keep token-mean losses on padded variable-length batches.

- ``StepWeighting`` (one process): a step's counted losses give the gradient of the count-weighted
  mean; a step that mixes counted and uncounted losses, a bad count and a step with no tokens at all
  are refused, each in one line naming the fix;
- CPU, gloo, 2 and 3 ranks (``tests/integrations_tokens.py``): ``BalanceTrainer`` within 2e-5 of
  transformers' own ``Trainer`` (3 full-batch AdamW steps, cosine schedule, clipping; tiny GPT-2 on
  padded sequences of 3-24 tokens) with the script's own split and uneven ones (accumulation 1-3,
  micro-steps of unequal sizes, checkpointed blocks), where the old per-sample weighting is off by more
  than 1e-3; Lightning's ``{"loss", "count"}`` and Accelerate's ``backward(loss, count=)`` within 2e-5 of
  one process's AdamW on the whole batch's token mean, where leaving the count out is off by more than
  1e-3; ``average_tokens_across_devices=False`` refused;
- ``autobalance verify`` on an uneven split of each framework's token-mean script: verified with the
  count (for the ``Trainer``: a model that takes ``num_items_in_batch``), refused without it, the refusal
  naming that framework's fix;
- ``tune`` on ``examples/hf`` with padded variable-length sequences, rank 0 holding extras under a
  memory cap, saves a verified uneven configuration.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError
from autobalance.runtime import RankWeight
from autobalance.runtime._rank_weighting import StepWeighting
from autobalance.verify import TOKEN_MEAN_FIXES
from tests.tune_helpers import REPO, cli

FRAMEWORKS = ("lightning", "transformers", "accelerate")


def _weighting(hook: RankWeight | None = None) -> StepWeighting:
    weights = StepWeighting(config=BalanceConfig(micro_batches=[4], accumulation=2, global_batch=8), rank=0,
                            world_size=1, device=torch.device("cpu"), framework="accelerate",
                            waiting=contextlib.nullcontext)
    weights.hook = hook
    return weights


def test_counted_losses_give_the_count_weighted_mean_on_one_process():
    """Two micro-batches whose losses average over 3 and 5 tokens, each divided by the accumulation as a
    framework does: the gradients after the step's last backward are those of ``(3 l0 + 5 l1) / 8``.
    Fails if the counts are dropped (sample weights give ``(l0 + l1) / 2``) or the rescale is lost."""
    torch.manual_seed(0)
    model, ref = nn.Linear(3, 1), nn.Linear(3, 1)
    ref.load_state_dict(model.state_dict())
    xs = [torch.randn(4, 3), torch.randn(4, 3)]
    counts = [torch.tensor(3), 5.0]
    weights = _weighting()
    for i, (x, count) in enumerate(zip(xs, counts, strict=True)):
        factor = weights.counted(count, micro_index=i, last=i == 1)
        (model(x).square().mean() * factor / 2).backward()
        weights.after_backward(model.parameters())
    assert weights.total == 8.0
    ((3 * ref(xs[0]).square().mean() + 5 * ref(xs[1]).square().mean()) / 8).backward()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    weights.step_end()
    assert weights.mode is None and weights.total is None


def test_counted_losses_set_the_hooks_weight_and_samples_put_it_back():
    """With a DDP hook the rank's correction is the hook's weight ``P / T`` (``P``: the first micro-batch's
    count times accumulation and world size); a next step without counts weights the rank by ``n_r / N``."""
    hook = RankWeight(weight=1.0)
    weights = _weighting(hook)
    assert weights.counted(2, micro_index=0, last=False) == pytest.approx(2 * 2 / 4)  # P = 2 * 2 * 1
    weights.counted(6, micro_index=1, last=True)
    assert hook.weight == pytest.approx(4 / 8) and weights.rescale is None
    weights.step_end()
    assert weights.samples(micro_index=0, size=4) == 1.0 and hook.weight == 1.0


def test_a_loss_the_framework_normalised_is_averaged_over_the_ranks_as_ddp_does():
    """transformers' ``num_items_in_batch`` loss (already over the step's tokens on every rank, times the
    world size): factor 1 and the hook's weight ``1 / W``, not the samples' ``n_r / N`` (7 / 11 here)."""
    hook = RankWeight(weight=1.0)
    weights = StepWeighting(config=BalanceConfig.any_split(rank_samples=[7, 4], accumulation=2), rank=0,
                            world_size=2, device=torch.device("cpu"), framework="hf", waiting=contextlib.nullcontext)
    weights.hook = hook
    assert weights.normalised(micro_index=0) == 1.0 and hook.weight == 0.5
    weights.step_end()
    assert weights.samples(micro_index=0, size=4) == pytest.approx(2 * 4 / 7) and hook.weight == pytest.approx(7 / 11)


def test_a_step_that_mixes_counted_and_uncounted_losses_is_refused():
    weights = _weighting()
    weights.samples(micro_index=0, size=4)
    with pytest.raises(UsageError, match=r"micro-batch 1 of step 0 has a loss with a count, the step's first "
                                         r"without a count; hand a count for every micro-batch or for none"):
        weights.counted(3, micro_index=1, last=True)
    weights = _weighting()
    weights.normalised(micro_index=0)
    with pytest.raises(UsageError, match="normalised by the framework"):
        weights.samples(micro_index=1, size=4)


@pytest.mark.parametrize("count", [-1, float("nan"), "many", torch.tensor([1, 2])])
def test_a_bad_count_is_refused_naming_it(count):
    with pytest.raises(UsageError, match=r"count=.* for micro-batch 0 of step 0: it must be a finite number >= 0"):
        _weighting().counted(count, micro_index=0, last=False)


def test_a_step_without_any_token_is_refused():
    weights = _weighting()
    weights.counted(0, micro_index=0, last=False)
    with pytest.raises(UsageError, match="every micro-batch of step 0 on every rank has count 0"):
        weights.counted(0, micro_index=1, last=True)


def _torchrun(world: int, args: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", *args], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_token_means_give_the_frameworks_own_update(tmp_path, world):
    """``BalanceTrainer`` against transformers' ``Trainer``, Lightning and Accelerate with the count line
    against the whole batch's token mean: the script's own split and three uneven ones within 2e-5 after
    3 AdamW steps, and an uneven split's SGD update within 2e-5 (a loss scaled by a constant shows there);
    the controls (the old per-sample weighting, the count left out) off by more than 1e-3, so the check
    can fail."""
    for name in FRAMEWORKS:
        pytest.importorskip(name)
    out = tmp_path / "tokens.json"
    proc = _torchrun(world, ["tests/integrations_tokens.py", str(out), "hf,lightning,accelerate"], timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert sorted(results) == ["accelerate", "hf", "lightning"]
    for name, r in results.items():
        for run in ("own", "acc1", "acc2", "acc3", "sgd_update"):
            assert r[run] <= 2e-5, (name, run, r)
        control = r["per_sample" if name == "hf" else "no_count"]
        assert control > 1e-3, (name, r)
    refused = results["hf"]["refused"]
    assert refused.startswith("BalanceTrainer: TrainingArguments(average_tokens_across_devices=False) on "
                              f"{world} ranks") and "set average_tokens_across_devices=True" in refused, refused


@pytest.mark.slow
@pytest.mark.parametrize(("framework", "module"), [("lightning", "lightning"), ("accelerate", "accelerate"),
                                                   ("hf", "transformers")])
def test_verify_takes_a_counted_uneven_split_and_refuses_it_without_naming_the_fix(tmp_path, framework, module):
    """One uneven split (5 + 11) of the framework's token-mean script: verified with the count; without
    it the fp32 step differs far above the floor and the refusal names this framework's fix."""
    pytest.importorskip(module)
    script = str(REPO / "tests" / "scripts" / "framework_tokens.py")
    path = tmp_path / "c.json"
    path.write_text(BalanceConfig(micro_batches=[5, 11], global_batch=16).to_json())
    verdicts = {}
    for label, extra in (("count", []), ("no_count", ["--no-count"])):
        proc = cli(["verify", script, "--config", str(path), "--device", "cpu", "--runs-dir", str(tmp_path / label),
                    "--trial-timeout", "120", "--json", "--", "--framework", framework, *extra],
                   cwd=tmp_path, timeout=300)
        assert proc.stdout.strip(), proc.stderr[-3000:]
        verdicts[label] = (proc.returncode, json.loads(proc.stdout))
    code, verdict = verdicts["count"]
    assert code == 0 and verdict["passed"], verdict["reason"]
    code, verdict = verdicts["no_count"]
    assert code == 1 and verdict["failure"] == "math", verdict["reason"]
    assert {c["name"]: c for c in verdict["checks"]}["equivalence"]["grad_rel"] > 1e-3, verdict
    assert f"a mean over tokens (padding, ignore_index) needs {TOKEN_MEAN_FIXES[framework]}" in verdict["reason"]


SLOW_RANK0 = {"AUTOBALANCE_EMULATE_MS_PER_SAMPLE": "100,0"}
"""Rank 0 emulated 100 ms per sample slower, as in ``test_integrations``: the best split gives it fewer."""


@pytest.mark.slow
def test_tune_on_a_padded_hf_script_saves_a_verified_uneven_configuration(tmp_path: Path):
    """``examples/hf --variable-length`` (padded sequences of 4-32 tokens, transformers' token mean): the
    script's own split does not fit under the cap on rank 0 (it holds extras); tune saves an uneven split,
    verified in fp32 against the baseline (before issue 42 every uneven split failed verification here)."""
    pytest.importorskip("transformers")
    db = tmp_path / "ab.db"
    # 6 trials: the reference run that fixes the exchange rate (the script's own split fits nowhere) takes one
    proc = cli(["tune", str(REPO / "examples" / "hf" / "train.py"), "--trials", "6", "--seed", "0",
                "--nproc-per-node", "2", "--device", "cpu", "--storage", f"sqlite:///{db}", "--study-name", "hf",
                "--memory-cap-gib", "0.0127", "--trial-timeout", "120", "--runs-dir", str(tmp_path / "runs"), "--",
                "--samples", "256", "--rank0-extra-mib", "3", "--variable-length"],
               cwd=tmp_path, timeout=600, env=SLOW_RANK0)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Verified trial" in proc.stdout and "Saved trial" in proc.stdout, proc.stdout[-3000:]
    best = cli(["best", "--study-name", "hf", "--storage", f"sqlite:///{db}", "--format", "json"], cwd=tmp_path,
               timeout=120)
    assert best.returncode == 0, best.stdout + best.stderr
    saved = json.loads(best.stdout)
    config, figures = BalanceConfig.from_dict(saved["config"]), saved["figures"]
    assert figures["baseline"]["status"] == "oom", figures["baseline"]
    assert figures["status"] == "ok" and figures["verification"]["passed"], figures
    assert not figures["verification"].get("skipped"), figures
    assert config.samples_per_rank[0] < config.samples_per_rank[1], config  # uneven, away from the slow rank
