"""The protocol between the rooms: statuses, the rank report (one validator, a lossless JSON round
trip), and which trial is feasible / the best."""

from __future__ import annotations

import json

import optuna
import pytest

from autobalance.protocol import (
    CONSTRAINTS_KEY,
    OUTCOME_STATUSES,
    REPORT_STATUSES,
    InvalidReport,
    RankDevice,
    RankReport,
    Status,
    StudyAttr,
    TrialAttr,
    best_trial,
    is_feasible,
    looks_like_oom,
    looks_like_peer_failure,
    report_problem,
)

FULL = {
    "schema": 1, "status": "ok", "error": None, "traceback": None, "rank": 1, "local_rank": 1, "world_size": 2,
    "hostname": "h", "pid": 12, "trial_id": "t", "device": {"type": "cpu", "name": "cpu", "capacity_bytes": 8e9,
                                                             "cap_bytes": None, "uuid": None, "identity": "cpu"},
    "config": {"global_batch": 8}, "source": "trial", "defaults": {"global_batch": 8}, "model": {"num_blocks": 2},
    "steps_done": 5, "warmup_steps": 2, "step_times_s": [0.1, 0.2, 0.3], "step_time_s": 0.2, "step_time_iqr_s": 0.1,
    "measured_steps": 3,
    "step_samples": [8, 8, 8], "partial_steps": 0, "samples_per_step": 8.0, "samples_per_s": 40.0,
    "busy_time_s": 0.15, "allreduce_wait_s": 0.05,
    "data": {"samples": 64, "global_batch": 8, "steps_per_epoch": 8, "dropped": 0},
    "memory": {"peak_allocated": 1.0, "peak_reserved": 2.0, "outside_pytorch": 0, "nvml_used_peak": None,
               "nvml_scope": "none", "peak_device": 2.0, "before_training": 0.5, "compile_step": None,
               "steady": None},
    "timing": {"startup_s": 1.0, "compile_s": None, "steps_s": 0.9, "measure_s": 0.0, "wall_s": 2.0},
    "compile": {"mode": "off"}, "activation_budget": None, "verify": None, "breakdown": None,
    "optimizer": {"sharding": "zero1", "wrapped": True, "state_bytes": 4096, "param_bytes": 2048,
                  "total_param_bytes": 8192, "shares": [0.75, 0.25], "params_owned": [3, 1]},
    "warm": None,
    "torch_version": "2.6", "cuda_version": None, "written_at": "now",
}


def test_status_is_its_string():
    assert Status.OK == "ok" and f"{Status.PREDICTED_OOM}" == "predicted_oom"
    assert json.dumps({"s": Status.PEER_FAILED}) == '{"s": "peer_failed"}'
    assert set(REPORT_STATUSES) < set(Status) and set(OUTCOME_STATUSES) < set(Status)
    assert {"predicted_oom", "surplus", "peer_failed", "stale"} <= {s.value for s in Status}


def test_full_report_round_trips_unchanged():
    report = RankReport.from_dict(FULL)
    assert report.status is Status.OK and report.memory is not None and report.memory.peak_device == 2.0
    assert report.timing is not None and report.timing.steps_s == 0.9
    assert report.to_dict() == FULL
    assert list(report.to_dict()) == list(FULL)  # same key order: same JSON text
    extra = {**FULL, "memory": {**FULL["memory"], "new_figure": 3}}
    assert RankReport.from_dict(extra).to_dict() == extra  # unknown section keys survive


def test_setup_failure_report_reads_with_defaults():
    report = RankReport.from_dict({"status": "error", "error": "ConfigError: bad", "rank": 0, "world_size": 2})
    assert report.memory is None and report.step_time_s is None and report.error == "ConfigError: bad"


def test_a_section_is_given_back_as_it_was_read():
    """The baseline stores its device section as the rank wrote it (StudyAttr.DEVICE): no key added."""
    read = RankReport.from_dict({**FULL, "device": {"type": "cuda", "tf32": False, "capacity_bytes": 8e9}})
    assert read.device is not None and read.device.as_read() == {"type": "cuda", "tf32": False, "capacity_bytes": 8e9}
    assert list(read.device.as_read()) == ["type", "tf32", "capacity_bytes"]
    assert "uuid" in read.device.to_dict()  # the whole section, as the runtime writes it
    built = RankDevice(type="cpu", name="x")
    assert built.as_read() == built.to_dict()


def test_reports_are_parsed_where_they_are_read(tmp_path):
    """read_reports gives typed reports (the one place a rank's JSON is parsed); an outcome handed a
    report as its JSON object parses it, and refuses one that is not a valid report."""
    from autobalance.launcher import TrialOutcome, read_reports

    (tmp_path / "rank0.json").write_text(json.dumps({**FULL, "rank": 0}))
    (tmp_path / "rank1.json").write_text(json.dumps({**FULL, "step_time_s": "slow"}))
    reports, problems = read_reports(str(tmp_path), 2)
    assert isinstance(reports[0], RankReport) and reports[0].to_dict() == {**FULL, "rank": 0}
    assert set(problems) == {1} and "step time" in problems[1]
    outcome = TrialOutcome(status=Status.OK, reason="", reports={1: FULL})
    assert isinstance(outcome.reports[1], RankReport) and outcome.reports[1].step_time_s == 0.2
    with pytest.raises(InvalidReport, match="without device"):
        TrialOutcome(status=Status.OK, reason="", reports={0: {"status": "ok", "step_time_s": 0.1, "memory": {}}})


@pytest.mark.parametrize(("data", "words"), [
    ({**FULL, "status": "pwned"}, "status 'pwned' is not one of"),
    ({**FULL, "memory": "lots"}, "memory is not an object"),
    ({**FULL, "step_time_s": -1}, "an ok report without a step time"),
    ({**FULL, "timing": {"steps_s": "soon"}}, "timing.steps_s is not a non-negative number"),
    ({**FULL, "measured_steps": True}, "measured_steps is not a non-negative number"),
    ({**FULL, "optimizer": {"state_bytes": -1}}, "optimizer.state_bytes is not a non-negative number"),
    ({**FULL, "step_times_s": [0.1, float("nan")]}, "step_times_s is not a list"),
    ([1], "a JSON list, not an object"),
])
def test_one_validator_rejects_garbage(data, words):
    assert words in (report_problem(data) or "")
    with pytest.raises(InvalidReport, match=words.split("'")[0]):
        RankReport.from_dict(data)


def test_markers():
    assert looks_like_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")
    assert looks_like_oom("RuntimeError: DefaultCPUAllocator: can't allocate memory")
    assert not looks_like_oom("ValueError: bad shape")
    assert looks_like_peer_failure("torch.distributed.DistBackendError: NCCL error")
    assert not looks_like_peer_failure("ZeroDivisionError")


def _trial(study, values, status, constraint):
    trial = study.ask()
    trial.set_user_attr(TrialAttr.STATUS, status)
    study._storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_KEY, [constraint])
    return study.tell(trial, values)


def test_feasible_and_best():
    study = optuna.create_study(directions=["minimize", "minimize"])
    study.set_user_attr(StudyAttr.OBJECTIVE, {"weight_spread": 1.0, "weight_time": 10.0})
    a = _trial(study, [0.0, 1.0], Status.OK, 0.0)     # 10
    b = _trial(study, [0.5, 0.5], Status.OK, -0.1)    # 5.5: best
    c = _trial(study, [0.0, 0.1], Status.OOM, 1.0)    # infeasible
    d = _trial(study, [0.0, 0.1], Status.OK, 0.2)     # over the memory limit
    assert [is_feasible(t) for t in (a, b, c, d)] == [True, True, False, False]
    best = best_trial(study)
    assert best is not None and best.number == b.number
    assert best_trial(optuna.create_study()) is None
