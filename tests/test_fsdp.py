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
    ({"param_sharding": "blocks", "compile": "default", "compile_scope": "regional"}, "compile='default'"),
    ({"param_sharding": "embeddings", "compile": "default"}, "compile_scope='whole'"),
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


def test_embedding_like_modules_are_found_named_or_left_with_the_root_when_tied() -> None:
    from torch import nn

    from autobalance.runtime import find_blocks, find_embeddings

    class Net(nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.tok = nn.Embedding(1000, 16)
            self.pos = nn.Embedding(8, 16)  # small: not embedding-like
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)) for _ in range(2)])
            self.head = nn.Linear(16, 1000, bias=False)
            if tie:
                self.head.weight = self.tok.weight

    model = Net(tie=False)
    _, blocks = find_blocks(model)
    assert [n for n, _ in find_embeddings(model, blocks)] == ["tok", "head"]
    assert [n for n, _ in find_embeddings(model, blocks, ["head"])] == ["head"]
    tied = Net(tie=True)
    assert find_embeddings(tied, find_blocks(tied)[1]) == []  # a shared weight stays in one unit: the root's
    with pytest.raises(ConfigError, match="tied"):
        find_embeddings(tied, find_blocks(tied)[1], ["tok"])
    with pytest.raises(ConfigError, match="embeddings=\\['lm_head'\\]"):
        find_embeddings(model, blocks, ["lm_head"])


def test_framework_integrations_refuse_parameter_sharding_in_one_line() -> None:
    from types import SimpleNamespace

    from autobalance.runtime import FrameworkLoop

    plan = SimpleNamespace(config=BalanceConfig(micro_batches=[2, 2], global_batch=4, param_sharding="embeddings"))
    with pytest.raises(ConfigError) as err:
        FrameworkLoop(plan, framework="lightning")  # type: ignore[arg-type]
    assert "param_sharding='embeddings'" in str(err.value) and "\n" not in str(err.value)


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
    gathered weights kept or not, the blocks compiled (regional) beside sharded embeddings: 3 AdamW
    steps give one process's fp32 parameters within :data:`TOLERANCE`. The control (every micro-batch
    weighted alike on an uneven split) is far off."""
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
        compiled = [c for c in checked if c["config"]["compile"] != "off"]
        assert compiled and compiled[0]["compiled_blocks"] == 3, compiled  # the blocks compiled, embeddings sharded
        tail = next(c for c in checked if c["name"] == "blocks epoch tail")
        assert tail["steps_total"] == [7, 7, 5] and tail["steps_micro"][2] == [2, 2], tail  # same micro-steps
    control = [c for c in cases if c["wrong_weights"]]
    assert control and min(control[0]["max_abs"]) > 100 * TOLERANCE, control


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_save_at_step_2_resume_step_3_equals_the_unbroken_run(tmp_path_factory, world):
    """``plan.full_state_dict`` at step 2 (rank 0, plain parameter names), a fresh model with other
    weights loading it (``plan.load_full_state_dict``), step 3: bitwise the unbroken sharded run when
    resumed sharded; within :data:`TOLERANCE` when a sharded run resumes under DDP or a DDP run sharded."""
    resume = {r["name"]: r for r in fsdp_check(world, tmp_path_factory)["resume"]}
    assert set(resume) == {"sharded into sharded", "sharded into DDP", "DDP into sharded"}
    assert resume["sharded into sharded"]["step3_max_abs"] == 0.0
    for r in resume.values():
        assert r["step3_max_abs"] <= TOLERANCE, r
        assert r["saved_keys"] == r["plain_keys"], r  # loadable into the plain model


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_live_tensor_peaks_fall_by_the_sharded_share_of_params_grads_and_state(tmp_path_factory, world):
    """Live CPU tensor peaks per rank (a step's, once AdamW's state is allocated; the lowest of 15)
    against DDP (gradients as bucket views, one copy): they fall by ``(1 - 1/world)`` of the sharded parameters, their gradients and their
    optimizer state, less the largest unit's gathered weights (whole while it computes), within 10 %:
    the search's prediction (``ShardingFacts.predicted_saving``) from the report's model facts."""
    from autobalance.tuner.search import ShardingFacts

    ddp, *sharded = fsdp_check(world, tmp_path_factory)["memory"]
    assert ddp["sharding"] is None and [m["sharding"]["mode"] for m in sharded] == ["embeddings", "blocks"]
    total_state = ddp["ranks"][0]["state_bytes"]
    facts = ShardingFacts.from_model(ddp["model"], world)  # what the baseline (DDP) reports
    assert facts is not None and facts.searched(usable=ddp["ranks"][0]["peak"])
    for m in sharded:
        info = m["sharding"]
        predicted = facts.predicted_saving(BalanceConfig.from_dict(m["config"]), state_total=total_state)
        assert info["sharded_bytes"] == facts.sharded_bytes(info["mode"]), (info, facts)
        assert info["largest_unit_bytes"] == facts.largest_unit(info["mode"]), (info, facts)
        assert predicted > 0.2 * ddp["ranks"][0]["peak"], (predicted, ddp)  # a real saving is compared
        for r in range(world):
            fell = ddp["ranks"][r]["peak"] - m["ranks"][r]["peak"]
            assert abs(fell - predicted) <= 0.1 * predicted, (m["describe"], r, fell, predicted)
            assert m["ranks"][r]["state_bytes"] < total_state  # the state is sharded too


# ------------------------------------------------------------------------------------ the search

def _facts(**kw: Any) -> Any:
    from autobalance.tuner.search import ShardingFacts

    base = dict(world_size=2, param_bytes=100.0, embedding_bytes=80.0, largest_embedding=40.0, block_bytes=8.0,
                num_blocks=2)
    return ShardingFacts(**{**base, **kw})


def test_space_searches_param_sharding_and_round_trips_a_config() -> None:
    from autobalance.tuner.search._space import SearchSpace

    space = SearchSpace.build(world_size=2, global_batch=8, num_layers=2, dtypes=["fp32", "fp16"],
                              max_accumulation=2, any_split=True)
    assert "param_sharding" not in space.distributions()
    assert SearchSpace.from_dict({k: v for k, v in space.to_dict().items()
                                  if k != "param_shardings"}).param_shardings == ["off"]  # studies from before
    space.param_shardings = ["off", "embeddings", "blocks"]
    assert {"param_sharding", "keep_gathered"} <= set(space.distributions())
    for cfg in (BalanceConfig.any_split(rank_samples=[3, 5], param_sharding="blocks", keep_gathered=["blocks"]),
                BalanceConfig.any_split(rank_samples=[3, 5], accumulation=2, param_sharding="embeddings",
                                        keep_gathered=["embeddings"]),
                BalanceConfig.any_split(rank_samples=[3, 5])):
        params = space.params_from_config(cfg)
        again = space.config_from_params(params)
        assert again.param_sharding == cfg.param_sharding and again.keep_gathered == cfg.keep_gathered
        assert space.contains(again)
    # what sharding refuses (fp16) is sampled unsharded, never an invalid configuration
    params = {**space.params_from_config(BalanceConfig.any_split(rank_samples=[3, 5], param_sharding="blocks")),
              "dtype": "fp16"}
    assert space.config_from_params(params).param_sharding == "off"
    plain = SearchSpace.build(world_size=2, global_batch=8, num_layers=2, dtypes=["fp32"], max_accumulation=1)
    assert not plain.contains(BalanceConfig.any_split(rank_samples=[4, 4], param_sharding="blocks"))


def test_dimension_is_searched_where_embedding_like_modules_are_large() -> None:
    from autobalance.tuner.search import ShardingFacts

    model = {"parameter_bytes": 1000, "embedding_bytes": 800, "largest_embedding_bytes": 400,
             "largest_block_bytes": 50, "num_blocks": 4}
    assert ShardingFacts.from_model(model, 2).searched(usable=10_000)  # 4 x 800 bytes: a third of the memory
    assert not ShardingFacts.from_model(model, 1).searched(usable=10_000)  # one rank: nothing to shard over
    assert not ShardingFacts.from_model(model, 2).searched(usable=100_000)  # 3 %: not worth a dimension
    assert not ShardingFacts.from_model({**model, "embedding_bytes": 0}, 2).searched(usable=10)  # none found
    assert ShardingFacts.from_model({"parameter_bytes": 1000, "num_blocks": 4}, 2) is None  # a report from before


def test_predicted_saving_follows_the_sharded_share_gradients_and_kept_groups() -> None:
    facts = _facts()
    one = BalanceConfig(micro_batches=[2, 2], global_batch=4, param_sharding="embeddings")
    # (1 - 1/2) * (80 weights + 80 gradients + 160 state) - 40 (the largest unit, gathered)
    assert facts.predicted_saving(one, state_total=200.0) == pytest.approx(0.5 * (80 + 80 + 160) - 40)
    accumulated = BalanceConfig(micro_batches=[1, 1], accumulation=2, global_batch=4, param_sharding="embeddings")
    assert facts.predicted_saving(accumulated, state_total=200.0) == pytest.approx(0.5 * (80 + 160) - 40)
    blocks = BalanceConfig(micro_batches=[2, 2], global_batch=4, param_sharding="blocks", keep_gathered=["blocks"])
    # everything sharded; the largest unit: an embedding-like module (40 > 8-byte blocks, 4-byte root)
    assert facts.predicted_saving(blocks, state_total=200.0) == pytest.approx(0.5 * (100 + 100 + 200) - 40 - 0.5 * 16)
    assert facts.predicted_saving(BalanceConfig(micro_batches=[2, 2], global_batch=4), state_total=200.0) == 0.0


class _Unsharded:
    """A stand-in for the eager memory model: 1000 bytes fixed + 10 a sample."""

    def can_predict(self, dtype: str) -> bool:
        return True

    def predict(self, *, rank: int, micro_batch: int, checkpointed: int, num_layers: int, dtype: str) -> float:
        return 1000.0 + 10.0 * micro_batch

    def fixed_bytes(self, rank: int, dtype: str) -> float:
        return 1000.0


def _trial(cfg: BalanceConfig, peaks: list[float], status: str = "ok", **attrs: Any) -> Any:
    import optuna

    from autobalance.protocol import TrialAttr

    return optuna.trial.create_trial(value=1.0, user_attrs={
        TrialAttr.STATUS: status, TrialAttr.CONFIG: cfg.to_dict(), TrialAttr.PEAK_DEVICE_GIB: [p / 2**30 for p in peaks],
        TrialAttr.FEASIBLE: attrs.pop("feasible", status == "ok"), **attrs})


def test_saving_is_learned_per_rank_from_one_sharded_trial() -> None:
    from autobalance.tuner.search import SavingModel

    facts = _facts()
    emb = BalanceConfig(micro_batches=[2, 6], global_batch=8, param_sharding="embeddings")
    model = SavingModel.fit([_trial(emb, [1020.0 - 300.0, 1060.0 - 280.0])], facts=facts, unsharded=_Unsharded(),
                            state_total=200.0)
    assert model.saving(emb, 0) == pytest.approx(300.0) and model.saving(emb, 1) == pytest.approx(280.0)
    assert model.source(emb) == "learned from its trials"
    other = BalanceConfig(micro_batches=[4, 4], global_batch=8, param_sharding="blocks")
    assert model.saving(other, 0) == pytest.approx(facts.predicted_saving(other, state_total=200.0))  # not seen
    assert SavingModel.fit([], facts=facts, unsharded=None).source(emb) == "predicted from the parameters"


def test_shard_proposal_where_the_fixed_part_is_large_and_nothing_fits() -> None:
    from autobalance.tuner.search import SavingModel
    from autobalance.tuner.search._sharding import sharding_proposal_config

    facts = _facts(param_bytes=1000.0, embedding_bytes=900.0, largest_embedding=450.0, block_bytes=20.0)
    savings = SavingModel(facts=facts, state_total=2000.0)
    base = BalanceConfig(micro_batches=[4, 4], global_batch=8, dtype="fp16", optimizer_sharding="zero1")
    kw = dict(space_shardings=["off", "embeddings", "blocks"], baseline=base, savings=savings)
    fixed = [4000.0, 4000.0]  # weights, gradients, two moments
    cfg, why = sharding_proposal_config(usable=[3600.0, 3600.0], fixed=fixed, any_fits=False, tried=set(), **kw)
    # embeddings save 0.5 * (900 + 900 + 1800) - 450 = 1350: 2650 left, below 85 % of 3600
    assert cfg.param_sharding == "embeddings" and cfg.micro_batches == [4, 4]
    assert cfg.dtype == "fp32" and cfg.optimizer_sharding == "off"  # what sharding refuses, left out
    assert "nothing unsharded fits" in why and "embeddings sharding leaves" in why
    tight, _ = sharding_proposal_config(usable=[3000.0, 3000.0], fixed=fixed, any_fits=False, tried=set(), **kw)
    assert tight.param_sharding == "blocks"  # 2650 > 85 % of 3000: the embeddings alone do not leave room
    again, _ = sharding_proposal_config(usable=[3600.0, 3600.0], fixed=fixed, any_fits=False, tried={cfg.to_json()},
                                        **kw)
    assert again.param_sharding == "blocks"  # the embeddings tried (and did not fit): shard more
    assert sharding_proposal_config(usable=[3600.0] * 2, fixed=fixed, any_fits=True, tried=set(), **kw) is None
    assert sharding_proposal_config(usable=[9000.0] * 2, fixed=fixed, any_fits=False, tried=set(), **kw) is None
    assert sharding_proposal_config(usable=[3600.0] * 2, fixed=fixed, any_fits=False, tried=set(),
                                    **{**kw, "space_shardings": ["off"]}) is None


def test_dominance_orders_configurations_by_how_much_they_shard() -> None:
    from autobalance.protocol import TrialAttr
    from autobalance.tuner.search import dominating_over_cap

    over = dict(status="oom", feasible=False, **{TrialAttr.FAILING_RANK: 0, TrialAttr.USABLE_GIB: [1.0, 1.0]})
    ddp_oom = _trial(BalanceConfig(micro_batches=[1, 1], global_batch=2), [2**31, 2**31], **over)
    sharded = BalanceConfig(micro_batches=[2, 2], global_batch=4, param_sharding="embeddings")
    assert dominating_over_cap([ddp_oom], sharded) is None  # sharding holds less: not implied
    shard_oom = _trial(BalanceConfig(micro_batches=[1, 1], global_batch=2, param_sharding="blocks"), [2**31, 2**31],
                       **over)
    for cfg in (sharded, BalanceConfig(micro_batches=[2, 2], global_batch=4),
                BalanceConfig(micro_batches=[1, 1], global_batch=2, param_sharding="blocks", keep_gathered=["blocks"])):
        assert dominating_over_cap([shard_oom], cfg) is not None, cfg  # no more sharding, no smaller batch
    assert dominating_over_cap([_trial(BalanceConfig(micro_batches=[1, 1], global_batch=2, param_sharding="blocks",
                                                     keep_gathered=["blocks"]), [2**31, 2**31], **over)],
                               BalanceConfig(micro_batches=[1, 1], global_batch=2, param_sharding="blocks")) is None


@pytest.mark.slow
def test_tune_on_the_vocabulary_heavy_example_saves_a_verified_sharded_configuration(tmp_path: Path) -> None:
    """``studies/vocab-cpu.toml``: 2 gloo ranks under a 19 MiB cap. The least memory DDP can take
    (one sample a micro-step on each rank, every block checkpointed, gradients as bucket views, 1 MiB
    buckets) runs out of memory under it, so every DDP split does (each needs at least as much on some
    rank), and every unsharded trial the study ran did. The search turns parameter sharding on (the
    embedding and head hold most parameters), proposes it, verifies and saves a sharded configuration,
    which then runs under the same cap in production."""
    from autobalance.protocol import StudyAttr, TrialAttr
    from tests.tune_helpers import cli, load

    db = tmp_path / "vocab.db"
    proc = cli(["tune", "--config", str(REPO / "studies/vocab-cpu.toml"), "--storage", f"sqlite:///{db}",
                "--trial-timeout", "120", "--runs-dir", str(tmp_path / "runs")], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = load(db, "vocab-cpu")
    assert study.user_attrs[StudyAttr.SPACE]["param_shardings"] == ["off", "embeddings", "blocks"]
    assert study.user_attrs[StudyAttr.MODEL]["embeddings"] == ["tok", "head"]
    unsharded = [t.user_attrs for t in study.trials if "param_sharding" not in t.user_attrs.get(TrialAttr.CONFIG, {})]
    assert unsharded and all(a.get(TrialAttr.FEASIBLE) is not True for a in unsharded), unsharded
    # the first trial of the search (after the baseline and the reference runs that fix the exchange rate)
    searched = [t for t in study.trials[1:] if not t.user_attrs.get(TrialAttr.REFERENCE_RUN)]
    assert searched[0].user_attrs.get(TrialAttr.PROPOSAL_PHASE) == "shard", [
        (t.number, t.user_attrs.get(TrialAttr.PROPOSAL_PHASE)) for t in study.trials]
    best = study.best_trial.user_attrs
    config = BalanceConfig.from_dict(best[TrialAttr.CONFIG])
    assert config.param_sharding != "off" and best[TrialAttr.FEASIBLE] is True, describe_config(config)
    assert f"Verified trial {study.best_trial.number}" in proc.stdout and \
        f"Saved trial {study.best_trial.number}" in proc.stdout, proc.stdout[-2000:]
    cap = {"AUTOBALANCE_MEMORY_CAP_BYTES": str(19 * 2**20), "AUTOBALANCE_DEVICE": "cpu"}
    least = BalanceConfig(micro_batches=[1, 1], accumulation=4, global_batch=8, checkpoint=[[0, 1], [0, 1]],
                          gradient_as_bucket_view=True, bucket_cap_mb=1.0)
    ddp = torchrun([str(REPO / "tests/scripts/with_config.py"), least.to_json(), str(REPO / "examples/vocab/train.py"),
                    "--max-steps", "2"], nproc=2, timeout=120, env=cap)
    assert ddp.returncode != 0 and "CPU memory budget exceeded" in ddp.stderr, ddp.stderr[-3000:]
    prod = torchrun([str(REPO / "examples/vocab/train.py"), "--max-steps", "2"], nproc=2, timeout=120,
                    env={"AUTOBALANCE_STUDY": "vocab-cpu", "AUTOBALANCE_STORAGE": f"sqlite:///{db}", **cap})
    assert prod.returncode == 0, prod.stderr[-3000:]
    assert f"parameter sharding: {config.param_sharding}" in prod.stdout and "done: 2 steps" in prod.stdout


def test_memory_model_proposes_sharded_splits_where_no_unsharded_one_fits() -> None:
    """The eager search with the savings: the unsharded model (1000 bytes fixed + 10 a sample) fits
    nothing under 900 usable bytes; with what each sharding saves per rank it proposes sharded splits,
    their peaks the unsharded ones less the saving, every one under the usable memory."""
    from autobalance.tuner.search import MemoryModel, MemoryObservation, SavingModel, StepTimeModel
    from autobalance.tuner.search._models import eager_candidates
    from autobalance.tuner.search._space import SearchSpace

    obs = [MemoryObservation(rank=r, micro_batch=mb, checkpointed=c, num_layers=2, dtype="fp32",
                             peak_bytes=1000.0 + mb * (10.0 - 4.0 * c / 2))
           for mb in (1, 2, 4) for c in (0, 2) for r in range(2)]
    model = MemoryModel.fit(obs, world_size=2)
    space = SearchSpace.build(world_size=2, global_batch=8, num_layers=2, dtypes=["fp32"], max_accumulation=2,
                              any_split=True)
    space.param_shardings = ["off", "embeddings", "blocks"]
    timing = StepTimeModel(a=1.0, b=1.0, g=1.0, k={"fp32": 1.0}, num_layers=2, prior={"fp32": 1.0})
    savings = SavingModel(facts=_facts(param_bytes=250.0, embedding_bytes=200.0, largest_embedding=100.0,
                                       block_bytes=20.0), state_total=500.0)
    kw = dict(space=space, model=model, timing=timing, usable=[900.0, 900.0], bucket=25.0, view=True,
              max_spread=None, score=lambda cfg, peaks, ms: max(peaks))
    assert eager_candidates(**kw) == []  # nothing unsharded fits
    found = eager_candidates(**kw, savings=savings)
    assert found and {c.config.param_sharding for c in found} <= {"embeddings", "blocks"}
    for c in found:
        unsharded = [model.predict(rank=r, micro_batch=c.config.micro_batches[r],
                                   checkpointed=len(c.config.checkpoint[r]), num_layers=2, dtype="fp32")
                     for r in range(2)]
        assert c.peaks == pytest.approx([u - savings.saving(c.config, r) for r, u in enumerate(unsharded)])
        assert max(c.peaks) * (1 + model.safety_margin) <= 900.0
