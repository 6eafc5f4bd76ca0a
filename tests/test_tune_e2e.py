"""`autobalance tune` end to end on CPU: real torchrun trials (2 ranks, gloo) into SQLite."""

from __future__ import annotations

import json

import optuna
import pytest

from autobalance import BalanceConfig
from tests.conftest import torchrun
from tests.tune_helpers import GPT, cli, load, tune_args

pytestmark = pytest.mark.slow


def test_tune_gpt_records_trials_with_per_rank_attributes(tmp_path):
    """Besides the attributes: fails if the study records a value without the spread term (the
    0.5 GiB cap makes rank 0's extra ~4 MiB a spread of about 1 % of capacity, far above the
    rounding of the attributes the value is recomputed from), or if ``autobalance studies`` loses
    or garbles the study's row (name, trial counts, best step time; it was checked with
    ``"s" in stdout``, always true)."""
    db = tmp_path / "a.db"
    proc = cli(tune_args(GPT, db, "--memory-cap-gib", "0.5", trials=3), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(db)
    trials = study.get_trials()
    assert len(trials) == 3
    base = trials[0]
    assert base.user_attrs["baseline"] is True
    assert base.user_attrs["config"]["micro_batches"] == [8, 8]  # the script's own default
    for t in trials:
        assert t.state == optuna.trial.TrialState.COMPLETE
        assert t.user_attrs["status"] == "ok"
        assert len(t.user_attrs["peak_device_gib"]) == 2
        assert all(p > 0 for p in t.user_attrs["peak_device_gib"])
        assert t.user_attrs["step_time_ms"] > 0
        assert t.system_attrs["constraints"][0] <= 0
        cfg = BalanceConfig.from_dict(t.user_attrs["config"])  # equal micro-batches or an any split
        assert sum(cfg.samples_per_rank) == cfg.global_batch == 16
    # rank 0 holds the EMA copy and the cached batch: the baseline is measurably uneven
    peaks = base.user_attrs["peak_device_gib"]
    assert peaks[0] > peaks[1]
    assert "Baseline" in proc.stdout and "best" in proc.stdout
    # the recorded objective: spread (fraction of capacity) + step time / the baseline's step time
    reference = load(db).user_attrs["autobalance:reference_step_s"]
    assert reference == pytest.approx(base.user_attrs["step_time_ms"] / 1000, abs=1e-6)
    for t in trials:
        spread = t.user_attrs["spread_pct_of_capacity"] / 100
        assert spread == pytest.approx((max(t.user_attrs["peak_device_gib"]) - min(t.user_attrs["peak_device_gib"])) / 0.5,
                                       abs=5e-4)
        assert spread > 0.002  # the ~4 MiB imbalance is visible at this cap
        expected = spread + t.user_attrs["step_time_ms"] / 1000 / reference
        assert t.values == [pytest.approx(expected, abs=5e-5)]
    # the best configuration was saved to the store and can be printed and exported
    best = cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"], cwd=tmp_path)
    assert best.returncode == 0, best.stderr
    assert '"micro_batches"' in best.stdout
    listing = cli(["trials", "--study-name", "s", "--storage", f"sqlite:///{db}"], cwd=tmp_path)
    assert listing.returncode == 0 and "baseline" in listing.stdout
    rows = json.loads(cli(["trials", "--study-name", "s", "--storage", f"sqlite:///{db}", "--json"],
                          cwd=tmp_path).stdout)
    # on CPU --measure-s auto is off: exactly --steps (3) measured steps, timed inside each trial's wall time
    assert [r["measured_steps"] for r in rows] == [3, 3, 3]
    assert all(0 < r["time_in_steps_s"] < r["wall_s"] for r in rows)
    studies = cli(["studies", "--storage", f"sqlite:///{db}"], cwd=tmp_path)
    assert studies.returncode == 0, studies.stderr
    # the study's row: name, 3 trials, 3 complete, 3 feasible, the best trial's step time
    rows = [[c.strip() for c in line.strip().strip("│").split("│")] for line in studies.stdout.splitlines()
            if line.count("│") >= 6]
    best_trial = min(trials, key=lambda t: t.values[0])
    assert [r[:5] for r in rows] == [["s", "3", "3", "3", f"{best_trial.user_attrs['step_time_ms']:.1f}"]], studies.stdout
    # a production job on the machine that tuned, under the same cap: the saved fingerprint matches it
    # (the CPU model the trials reported), and one line names the source of its configuration
    out = tmp_path / "plans"
    out.mkdir()
    prod = torchrun(["tests/scripts/show_plan.py"], env={
        "AUTOBALANCE_DEVICE": "cpu", "SHOW_PLAN_DIR": str(out), "AUTOBALANCE_STUDY": "s",
        "AUTOBALANCE_STORAGE": f"sqlite:///{db}", "AUTOBALANCE_MEMORY_CAP_BYTES": str(int(0.5 * 2**30))})
    assert prod.returncode == 0, prod.stderr[-3000:]
    using = [line for line in prod.stderr.splitlines() if line.startswith("autobalance: using")]
    trial = json.loads(best.stdout)["trial_number"]
    assert len(using) == 1 and using[0].startswith(f"autobalance: using study s, trial {trial} (sqlite:///{db}): "), using
    assert "(tuned) vs" not in prod.stderr, prod.stderr[-2000:]


# A script error on the first trial, and a hanging trial killed at --trial-timeout, are in the fault
# matrix: tests/faults/test_script_errors.py and tests/faults/test_trial_faults.py (one rank hanging
# in a collective); tests/test_scale_out.py kills a trial hanging on every rank of two nodes.


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--trials", "0"], ["--trials=0", "at least 1"]),
        (["--trials", "-3"], ["--trials=-3"]),
        (["--storage", "nosuchdb://x"], ["--storage", "nosuchdb://x"]),
        (["--sampler", "cmaes"], ["--sampler='cmaes'", "tpe"]),
        (["--memory-cap-gib", "1,2,3"], ["--memory-cap-gib has 3 values for 2 ranks"]),
        (["--global-batch", "1"], ["--global-batch=1"]),
    ],
)
def test_bad_input_one_line_errors(tmp_path, args, words):
    db = tmp_path / "a.db"
    base = tune_args(GPT, db)
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if flag in base:
            base[base.index(flag) + 1] = value
        else:
            base += [flag, value]
    proc = cli(base, cwd=tmp_path, timeout=60)
    assert proc.returncode in (1, 2)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0]
    assert not db.exists() or load_count(db) == 0


def load_count(db):
    try:
        return len(load(db).get_trials())
    except KeyError:
        return 0


def test_missing_and_non_python_script(tmp_path):
    for script, words in ((str(tmp_path / "nope.py"), "does not exist"), (str(tmp_path), "not a Python file")):
        proc = cli(tune_args(script, tmp_path / "a.db"), cwd=tmp_path, timeout=60)
        assert proc.returncode == 2
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
