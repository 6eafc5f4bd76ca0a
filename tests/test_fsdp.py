"""Parameter sharding with FSDP2 (``fully_shard``): the configuration field, the runtime against one
process on the whole global batch under torchrun (gloo, 2 and 3 ranks), save and resume, the
live-tensor peaks, the search's dimension."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autobalance._config import BalanceConfig, describe_config
from autobalance._errors import ConfigError
from tests.conftest import REPO, torchrun

# ------------------------------------------------------------------------------------ configuration


def test_param_sharding_round_trips_and_old_json_loads_unchanged() -> None:
    old = BalanceConfig(micro_batches=[2, 2], global_batch=4)
    assert old.param_sharding == "off" and old.keep_gathered == []
    assert "param_sharding" not in old.to_json() and "keep_gathered" not in old.to_json()
    cfg = BalanceConfig.any_split(rank_samples=[3, 5], accumulation=2, param_sharding="blocks",
                                  keep_gathered=["blocks", "embeddings"])
    assert cfg.keep_gathered == ["embeddings", "blocks"]  # one order, whatever the order given
    assert BalanceConfig.from_json(cfg.to_json()) == cfg
    assert describe_config(cfg).endswith("fsdp=blocks keep=embeddings+blocks")
    emb = BalanceConfig(micro_batches=[2, 2], global_batch=4, param_sharding="embeddings")
    assert describe_config(emb).endswith("bucket=25MB fsdp=embeddings")
    assert describe_config(emb.to_dict()) == describe_config(emb)  # the views read stored dicts


@pytest.mark.parametrize(("fields", "named"), [
    ({"param_sharding": "zero3"}, "param_sharding='zero3'"),
    ({"param_sharding": 1}, "param_sharding=1"),
    ({"keep_gathered": ["blocks"]}, "keep_gathered=['blocks']"),
    ({"param_sharding": "embeddings", "keep_gathered": ["blocks"]}, "keep_gathered=['blocks']"),
    ({"param_sharding": "blocks", "keep_gathered": ["blocks", "blocks"]}, "keep_gathered="),
    ({"param_sharding": "blocks", "keep_gathered": "blocks"}, "keep_gathered='blocks'"),
    ({"param_sharding": "blocks", "optimizer_sharding": "zero1"}, "optimizer_sharding='zero1'"),
    ({"param_sharding": "embeddings", "dtype": "fp16"}, "dtype='fp16'"),
    ({"param_sharding": "blocks", "compile": "default"}, "compile='default'"),
])
def test_bad_param_sharding_is_one_line_naming_field_value_and_fix(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        BalanceConfig(micro_batches=[2, 2], global_batch=4, **fields)
    text = str(err.value)
    assert named in text and "\n" not in text and ("use" in text or "set" in text or "list" in text or "fix" in text)


def test_different_micro_step_counts_with_sharding_are_refused_before_launch() -> None:
    """A rank with fewer samples than micro-steps would run fewer micro-steps: with sharding every
    forward all-gathers, so the others would wait forever. Refused when the configuration is built
    (the tuner and ``plan()`` build it before any collective), in one line naming the field, the value
    and the fix."""
    with pytest.raises(ConfigError) as err:
        BalanceConfig.any_split(rank_samples=[2, 9], accumulation=3, param_sharding="embeddings")
    text = str(err.value)
    assert "\n" not in text
    assert "rank_samples=[2, 9]" in text and "param_sharding='embeddings'" in text
    assert "same number of micro-steps" in text and "at least 3 samples" in text
    # through the JSON a trial or production reads
    with pytest.raises(ConfigError, match="same number of micro-steps"):
        BalanceConfig.from_json('{"rank_samples": [2, 9], "accumulation": 3, "global_batch": 11, '
                                '"param_sharding": "blocks"}')


def test_every_step_of_a_sharded_epoch_has_the_same_micro_steps_on_every_rank() -> None:
    """The partial last step too (DDP's gives each rank as few micro-steps as its largest micro-batch
    allows, which may differ): every sample once, each micro-batch within its rank's largest, a tail
    that cannot be split so dropped (never a step on which one rank gathers alone)."""
    import random

    from autobalance._config import split_at_least
    from autobalance.runtime import epoch_schedule

    rng = random.Random(0)
    differed = 0
    for _ in range(1500):
        world, acc = rng.randint(2, 4), rng.randint(1, 4)
        global_batch = rng.randint(world * acc, world * acc + 30)
        samples = split_at_least(global_batch, [rng.uniform(0.05, 1) for _ in range(world)], acc)
        n = rng.randint(1, 3 * global_batch)
        for mode in ("off", "blocks"):
            cfg = BalanceConfig.any_split(rank_samples=samples, accumulation=acc, param_sharding=mode)
            schedule = epoch_schedule(num_samples=n, config=cfg, epoch=0, seed=1)
            seen = [i for step in schedule.steps for rank in step.micro_batches for mb in rank for i in mb]
            assert len(seen) == len(set(seen)) == n - schedule.dropped
            for step in schedule.steps:
                for rank, mbs in enumerate(step.micro_batches):
                    assert all(1 <= len(mb) <= cfg.micro_batches[rank] for mb in mbs)
                counts = {len(mbs) for mbs in step.micro_batches}
                if mode == "off":
                    differed += len(counts) > 1
                else:
                    assert len(counts) == 1, (cfg, n, step)
    assert differed > 50  # the unsharded schedule does give ranks different counts: the check is not empty


# ------------------------------------------------------------------------------------ under torchrun

_RUNS: dict[int, dict[str, Any]] = {}

TOLERANCE = 1e-5
"""fp32 parameters after 3 AdamW steps (lr 1e-2: updates of ~1e-2 a step) against one process: the
summation orders differ (measured: at most 1e-6); a wrong weighting is off by ~1e-2 (the control)."""


def fsdp_check(world: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One torchrun launch per world size checks every configuration (``tests/dist_scripts/fsdp_check.py``)."""
    if world not in _RUNS:
        out = Path(tmp_path_factory.mktemp(f"fsdp{world}")) / "fsdp.json"
        proc = torchrun([str(REPO / "tests/dist_scripts/fsdp_check.py"), str(out)], nproc=world, timeout=420)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _RUNS[world] = json.loads(out.read_text())
    return _RUNS[world]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_update_equals_one_process_on_the_whole_global_batch(tmp_path_factory, world):
    """Each sharding choice (the embedding and head only, or every block and the root too), even and
    uneven splits over 2 micro-steps (and 1+3 samples in 3 micro-steps of rank 0's 1: sizes 1,1,1 against
    3,3,3), a token-mean loss with ``count=``, per-rank checkpointing, clipping by the global norm,
    gathered weights kept or not: 3 AdamW steps give one process's fp32 parameters within
    :data:`TOLERANCE`. The control (every micro-batch weighted alike on an uneven split) is far off."""
    cases = fsdp_check(world, tmp_path_factory)["cases"]
    checked = [c for c in cases if not c["wrong_weights"]]
    assert {c["sharding"]["mode"] for c in checked} == {"embeddings", "blocks"}
    assert any(c["tokens"] for c in checked) and any(c["clip"] for c in checked)
    assert any(any(c["config"]["checkpoint"]) for c in checked)
    assert any(c["config"].get("rank_samples") for c in checked) and any("rank_samples" not in c["config"] for c in checked)
    for c in checked:
        assert not c["ddp"], c["name"]  # the whole model through FSDP2, no DDP
        assert c["sharding"]["units"][:2] == ["tok", "head"], c  # found: the vocabulary-sized modules, not pos
        assert max(c["max_abs"]) <= TOLERANCE, (c["name"], c["max_abs"])
        assert min(c["scale"]) > 1000 * TOLERANCE, c  # the parameters moved: a real update was compared
    if world == 2:
        assert any(c["config"]["accumulation"] == 3 for c in checked)
        tail = next(c for c in checked if c["name"] == "blocks epoch tail")
        assert tail["steps_total"] == [7, 7, 5] and tail["steps_micro"][2] == [2, 2], tail  # same micro-steps
    control = [c for c in cases if c["wrong_weights"]]
    assert control and min(control[0]["max_abs"]) > 100 * TOLERANCE, control


@pytest.mark.slow
def test_save_at_step_2_resume_step_3_equals_the_unbroken_run(tmp_path_factory):
    """``plan.full_state_dict`` at step 2 (rank 0, plain parameter names), a fresh model with other
    weights loading it (``plan.load_full_state_dict``), step 3: bitwise the unbroken sharded run when
    resumed sharded; within :data:`TOLERANCE` when a sharded run resumes under DDP or a DDP run sharded."""
    resume = {r["name"]: r for r in fsdp_check(2, tmp_path_factory)["resume"]}
    assert set(resume) == {"sharded into sharded", "sharded into DDP", "DDP into sharded"}
    assert resume["sharded into sharded"]["step3_max_abs"] == 0.0
    for r in resume.values():
        assert r["step3_max_abs"] <= TOLERANCE, r
        assert r["saved_keys"] == r["plain_keys"], r  # loadable into the plain model


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_live_tensor_peaks_fall_by_the_sharded_share_of_params_grads_and_state(tmp_path_factory, world):
    """Live CPU tensor peaks per rank (steps 2-3, AdamW state allocated) against DDP (gradients as bucket
    views, one copy): they fall by ``(1 - 1/world)`` of the sharded parameters, their gradients and their
    optimizer state, less the largest unit's gathered weights (whole while it computes), within 10 %."""
    ddp, *sharded = fsdp_check(world, tmp_path_factory)["memory"]
    assert ddp["sharding"] is None and [m["sharding"]["mode"] for m in sharded] == ["embeddings", "blocks"]
    total_state = ddp["ranks"][0]["state_bytes"]
    for m in sharded:
        info = m["sharding"]
        share = info["sharded_bytes"] / m["param_bytes"]
        predicted = (1 - 1 / world) * (2 * info["sharded_bytes"] + share * total_state) - info["largest_unit_bytes"]
        assert predicted > 0.2 * ddp["ranks"][0]["peak"], (predicted, ddp)  # a real saving is compared
        for r in range(world):
            fell = ddp["ranks"][r]["peak"] - m["ranks"][r]["peak"]
            assert abs(fell - predicted) <= 0.1 * predicted, (m["describe"], r, fell, predicted)
            assert m["ranks"][r]["state_bytes"] < total_state  # the state is sharded too
