"""The memory models never predict below what a rank holds apart from activations: a fitted line
that goes below it (here below zero) is clamped, and the search proposes nothing from a clamped
prediction; a prediction outside the measured micro-batches is marked extrapolated on the trial line."""

from __future__ import annotations

import optuna
import pytest

from autobalance import BalanceConfig
from autobalance.protocol import TrialAttr
from autobalance.tuner import TuneSettings
from autobalance.tuner.search import SearchSpace
from autobalance.tuner.search._compiled_model import CompiledMemoryModel
from autobalance.tuner.search._memory_model import MemoryModel, MemoryObservation
from autobalance.tuner.search._policy import ModelAdvisor, proposal_line

MIB = 2**20
PARAMS = 4 * MIB


def _line_obs(**kw: object) -> list[MemoryObservation]:
    """Peaks 25 MiB at micro-batch 4 and 65 MiB at 8: the line is 10 MiB per sample from -15 MiB."""
    return [MemoryObservation(rank=0, micro_batch=m, checkpointed=0, num_layers=2, dtype="fp32",
                              peak_bytes=p * MIB, **kw) for m, p in ((4, 25), (8, 65))]  # type: ignore[arg-type]


def test_a_line_below_zero_is_clamped_at_the_parameters_and_flagged():
    model = MemoryModel.fit(_line_obs(parameter_bytes=PARAMS), world_size=1)
    q = dict(rank=0, checkpointed=0, num_layers=2, dtype="fp32")
    assert model.fitted_line(micro_batch=1, **q) == pytest.approx(-5 * MIB, rel=1e-6)  # below zero
    assert model.predict(micro_batch=0, **q) == pytest.approx(PARAMS)  # never below what the rank holds
    assert model.predict(micro_batch=1, **q) == pytest.approx(PARAMS)
    assert model.clamped(micro_batch=1, **q) and not model.clamped(micro_batch=2, **q)
    assert model.predict(micro_batch=8, **q) == pytest.approx(65 * MIB)
    # within the measured micro-batches: not extrapolated; outside them: extrapolated
    assert not model.extrapolated(micro_batch=6, **q)
    assert model.extrapolated(micro_batch=2, **q) and model.extrapolated(micro_batch=16, **q)
    # without any figure of what the rank holds, the floor is zero: a line below it is still impossible
    bare = MemoryModel.fit(_line_obs(), world_size=1)
    assert bare.predict(micro_batch=0, **q) == 0.0 and bare.clamped(micro_batch=1, **q)


def test_a_measured_held_part_is_the_floor_and_a_negative_slope_is_impossible():
    held = MemoryObservation(rank=0, micro_batch=0, checkpointed=0, num_layers=2, dtype="fp32",
                             peak_bytes=12 * MIB, held=True)
    model = MemoryModel.fit([*_line_obs(), held], world_size=1)
    assert model.floor_bytes(0) == pytest.approx(12 * MIB)
    assert all(model.predict(rank=0, micro_batch=m, checkpointed=0, num_layers=2, dtype="fp32") >= 12 * MIB
               for m in range(0, 9))
    falling = MemoryModel.fit([MemoryObservation(rank=0, micro_batch=m, checkpointed=0, num_layers=2, dtype="fp32",
                                                 peak_bytes=p * MIB) for m, p in ((2, 100), (4, 60))], world_size=1)
    # 20 MiB less per sample: more samples never take memory away, so every prediction of it is impossible
    assert falling.clamped(rank=0, micro_batch=3, checkpointed=0, num_layers=2, dtype="fp32")
    compiled = CompiledMemoryModel.fit([], eager=falling, num_layers=2)
    cfg = BalanceConfig(micro_batches=[3], accumulation=2, global_batch=6, dtype="fp32", checkpoint=[[]],
                        compile="default", activation_budget=[1.0])
    assert compiled.clamped(cfg)
    assert not compiled.fits(rank=0, micro_batch=3, budget=1.0, dtype="fp32", mode="default", limit=10**12)


def _study() -> optuna.Study:
    study = optuna.create_study()
    study.set_user_attr("autobalance:reference_step_s", 0.1)
    for m, acc, peak, ms in ((4, 2, 25, 100.0), (8, 1, 65, 80.0)):
        cfg = BalanceConfig(micro_batches=[m], accumulation=acc, global_batch=8, dtype="fp32", bucket_cap_mb=25.0,
                            gradient_as_bucket_view=True, checkpoint=[[]])
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.0, user_attrs={
            TrialAttr.STATUS: "ok", TrialAttr.CONFIG: cfg.to_dict(), TrialAttr.PEAK_DEVICE_GIB: [peak / 1024],
            TrialAttr.USABLE_GIB: [55 / 1024], TrialAttr.STEP_TIME_MS: ms, TrialAttr.PARAMETER_BYTES: PARAMS}))
    return study


def test_no_proposal_from_a_clamped_prediction_and_the_trial_line_says_extrapolated(tmp_path):
    """Usable 55 MiB: micro-batch 8 (65 MiB) does not fit; 4 (25 MiB) does; 2 is predicted at 5 MiB
    (outside the measured 4..8: extrapolated); 1 at -5 MiB, below the 4 MiB of parameters: clamped,
    never proposed (before the clamp it was proposed, predicted to fit in less than nothing)."""
    script = tmp_path / "train.py"
    script.write_text("")
    settings = TuneSettings(script=str(script), device="cpu", nproc_per_node=1, memory_cap_gib=[55 / 1024],
                            headroom=0.0)
    space = SearchSpace.build(world_size=1, global_batch=8, num_layers=2, dtypes=["fp32"], max_accumulation=8)
    found = ModelAdvisor(space=space, settings=settings).models.scored_candidates(_study())
    by_micro = {c.config.micro_batches[0]: c for c in found if not c.config.checkpoint[0]}
    assert 1 not in by_micro and 8 not in by_micro
    assert all(min(c.peaks) >= PARAMS for c in found)
    assert not by_micro[4].extrapolated and by_micro[2].extrapolated
    attrs = {TrialAttr.PROPOSAL_PHASE: "memory-model", "proposal_step_ms": 120.0,
             "proposal_peak_gib": [5 / 1024], "proposal_extrapolated": True}
    assert proposal_line(attrs) == "memory-model: 120 ms, 5.00 MiB predicted (extrapolated)"
