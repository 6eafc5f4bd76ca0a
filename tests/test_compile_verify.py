"""Compile with per-rank activation budgets and ``autobalance verify``, end to end on CPU
(real torchrun jobs, 2 ranks, gloo).

The compiled trial uses Inductor's C++ backend (a cold cache costs ~20 s per rank on 2 cores, a
warm one ~2 s); the tune-level tests use ``aot_eager_decomp_partition`` (the same partitioner and
activation budget, no C++ compile) through ``AUTOBALANCE_COMPILE_BACKEND`` to stay fast.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from autobalance import BalanceConfig
from autobalance.launcher import TrialLaunch, run_trial
from tests.bugs import inject
from tests.tune_helpers import GPT, REPO, capped_tune_args, cli, load

pytestmark = pytest.mark.slow

MLP = str(REPO / "examples" / "mlp" / "train.py")
SMALL_GPT = ["--", "--n-layer", "2", "--n-embd", "32", "--samples", "128"]
"""GPT script arguments of a smaller model (dropout 0.1 kept)."""
FAST_COMPILE = {"AUTOBALANCE_COMPILE_BACKEND": "aot_eager_decomp_partition"}


def test_compiled_trial_applies_each_ranks_budget_with_inductor_and_its_cache(tmp_path):
    cfg = BalanceConfig(micro_batches=[12, 20], global_batch=32, compile="default", activation_budget=[0.3, 0.8])
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"), "OMP_NUM_THREADS": "1"}
    runs = []
    for i in range(2):  # the second run finds every graph in the persistent cache
        launch = TrialLaunch(script=MLP, nproc_per_node=2, device="cpu", config_json=cfg.to_json(), steps=2, warmup=1,
                             trial_dir=str(tmp_path / f"t{i}"), timeout_s=400, env=env, trial_id=f"c{i}{time.time()}")
        outcome = run_trial(launch)
        assert outcome.status == "ok", (outcome.reason, outcome.traceback[-3000:])
        runs.append(outcome.reports)
    for reports in runs:
        for rank, budget in ((0, 0.3), (1, 0.8)):
            rep = reports[rank]
            assert rep.activation_budget == budget  # what the partitioner read on this rank
            comp = rep.compile
            assert comp["mode"] == "default" and comp["backend"] == "inductor" and comp["activation_budget"] == budget
            assert comp["graphs"] >= 1 and comp["recompiles_after_first_step"] == 0
            assert rep.timing.compile_s > 0
            assert rep.step_time_s > 0 and len(rep.step_times_s) == 2  # the compile step is not measured
    cold = [runs[0][r].compile["cache"] for r in (0, 1)]
    warm = [runs[1][r].compile["cache"] for r in (0, 1)]
    assert all(c["fx_graph_misses"] > 0 for c in cold)
    assert all(c["fx_graph_hits"] > 0 and c["fx_graph_misses"] == 0 for c in warm)
    cold_s = max(runs[0][r].timing.compile_s for r in (0, 1))
    warm_s = max(runs[1][r].timing.compile_s for r in (0, 1))
    print(f"\ncompile on CPU (Inductor C++, MLP, 2 ranks): cold cache {cold_s:.1f} s, warm cache {warm_s:.1f} s")
    assert warm_s < cold_s


def _verify(tmp_path, cfg: BalanceConfig, *, env=None, name="c.json"):
    path = tmp_path / name
    path.write_text(cfg.to_json())
    return cli(["verify", GPT, "--config", str(path), "--device", "cpu", "--runs-dir", str(tmp_path / "runs"),
                "--json", *SMALL_GPT], cwd=tmp_path, env=env, timeout=400)


def test_verify_passes_a_correct_uneven_config_and_fails_deliberately_wrong_runtimes(tmp_path):
    """The verify gate against the two known-wrong runtimes of tests/bugs: fails if verify passes a
    runtime whose loss weighting is disabled (each rank's mean loss counts the same, whatever its
    share), or one that checkpoints without preserving the RNG state (other dropout masks in the
    recomputation); also fails if the injection stops reaching the ranks (both verdicts would then
    pass) or if the correct runtime is rejected."""
    cfg = BalanceConfig(micro_batches=[3, 13], global_batch=16, checkpoint=[[0], []])
    ok = _verify(tmp_path, cfg)
    assert ok.returncode == 0, ok.stderr[-3000:] + ok.stdout[-3000:]
    verdict = json.loads(ok.stdout)
    assert verdict["passed"] is True
    checks = {c["name"]: c for c in verdict["checks"]}
    assert checks["equivalence"]["grad_rel"] <= 1e-6 and checks["equivalence"]["param_rel"] <= 1e-6
    assert checks["rng-replay"]["grad_rel"] <= 1e-6  # checkpointing replays dropout exactly

    # the uneven loss weighting dropped (tests/bugs): each rank's mean loss counts the same, whatever its share
    wrong = _verify(tmp_path, cfg, env=inject("loss-weighting"))
    assert wrong.returncode == 1, wrong.stderr[-3000:]
    verdict = json.loads(wrong.stdout)
    assert verdict["passed"] is False and "differs from the baseline" in verdict["reason"]
    assert {c["name"]: c for c in verdict["checks"]}["equivalence"]["grad_rel"] > 0.01

    # checkpointing without preserved RNG state: the recomputation draws other dropout masks
    no_rng = _verify(tmp_path, cfg, env=inject("no-rng-preserve"))
    assert no_rng.returncode == 1, no_rng.stderr[-3000:]
    verdict = json.loads(no_rng.stdout)
    assert verdict["passed"] is False and "dropout masks are not replayed" in verdict["reason"]


def test_verify_bf16_uses_the_baselines_own_error(tmp_path):
    """Fails if the dtype check's tolerance is not 4x (a literal here, not the implementation's
    NOISE_FACTOR) the baseline's own bf16 error, or if the split's math is not first checked in fp32."""
    proc = _verify(tmp_path, BalanceConfig(micro_batches=[5, 11], global_batch=16, dtype="bf16"))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    verdict = json.loads(proc.stdout)
    floor, math, noise, eq = verdict["checks"]
    # the rounding floor, then the split's math with both in fp32 within 20x that floor; then the dtype
    # against the baseline's own rounding
    assert floor["name"] == "floor" and floor["runs"] == ["floor", "baseline"]
    assert math["name"] == "equivalence" and math["runs"] == ["tuned-fp32", "baseline"]
    assert math["tolerance"][0] == verdict["bound"] == max(1e-6, 20 * floor["grad_rel"])
    assert math["grad_rel"] <= verdict["bound"]
    assert noise["name"] == "noise" and noise["runs"] == ["baseline-bf16", "baseline"]
    assert 1e-6 < noise["grad_rel"] < 0.1
    assert eq["name"] == "dtype" and eq["runs"] == ["tuned", "baseline"]
    assert eq["tolerance"][0] == pytest.approx(max(verdict["bound"], 4 * noise["grad_rel"]))
    assert eq["grad_rel"] <= eq["tolerance"][0]


def test_a_run_that_takes_the_baseline_step_is_reused_not_launched_again(tmp_path):
    """The script's own split, compiled in bf16 (what the H200 study saved): part 1 (the split, eager
    in fp32) is the baseline's own step, so verification reuses the baseline run and the arrangement
    matches exactly; the compiled bf16 run is launched. Fails if the fp32 run is launched again, or
    if the reuse crosses into another configuration (the compiled run)."""
    cfg = BalanceConfig(micro_batches=[8, 8], global_batch=16, dtype="bf16", compile="default",
                        activation_budget=[1.0, 1.0])
    proc = _verify(tmp_path, cfg, env=FAST_COMPILE)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    verdict = json.loads(proc.stdout)
    checks = {c["name"]: c for c in verdict["checks"]}
    runs = verdict["runs"]
    assert runs["tuned-fp32"] == runs["baseline"], runs
    assert "tuned-fp32" not in verdict["seconds"] and "tuned" in verdict["seconds"]  # timed only when launched
    assert checks["equivalence"]["grad_rel"] == 0.0 and checks["equivalence"]["param_rel"] == 0.0
    assert "tuned-fp32 run: the same step as the baseline run, reused" in proc.stderr
    assert len(set(runs.values())) == len(runs) - 1 == 4  # baseline, floor, baseline-bf16, tuned: launched once each


def test_verify_passes_a_compiled_config_whose_micro_steps_differ_on_one_rank(tmp_path):
    """One rank, micro-steps 6, 5, 5 compiled (a dynamic batch dimension; the model itself is the
    compiled module, so the runtime's forward hooks run inside it) under verification's no-dropout
    mode: on the H200 (benchmarks/2026-12-03-h200c) the fastest trial of two studies failed here with
    ``TypeError: int() ... not 'torch.Size'`` (the hook's ``numel()`` answered with a size once Dynamo
    had run the mode's ``__torch_function__``) and a slower trial was saved. Fails if that comes back."""
    cfg = BalanceConfig(micro_batches=[6], accumulation=3, global_batch=16, rank_samples=[16], compile="default",
                        activation_budget=[1.0])
    assert cfg.micro_step_sizes(0) == [6, 5, 5]
    proc = _verify(tmp_path, cfg, env={"AUTOBALANCE_COMPILE_BACKEND": "eager"})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    verdict = json.loads(proc.stdout)
    assert verdict["passed"] is True, verdict["reason"]


def test_a_compiled_study_proposes_from_the_compiled_model_records_compile_time_and_verifies_a_compiled_trial(tmp_path):
    """One compiled study (the model strategy, ``--compile on``): its trials after the eager
    baseline are compiled, with each rank's budget on the 0.05 grid and their compile time recorded;
    some are proposed by the compiled model (launched as proposed); a compiled trial then passes
    ``autobalance verify`` against the script's own eager step."""
    db = tmp_path / "a.db"
    args = ["tune", MLP, "--trials", "3", "--nproc-per-node", "2", "--device", "cpu", "--storage", f"sqlite:///{db}",
            "--study-name", "s", "--strategy", "model", "--seed", "0", "--trial-timeout", "120", "--compile", "on",
            "--dtypes", "fp32", "--runs-dir", str(tmp_path / "runs")]
    proc = cli(args, cwd=tmp_path, env=FAST_COMPILE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(db)
    assert study.user_attrs["autobalance:space"]["compile_modes"] == ["default"]
    trials = study.get_trials()
    base, tuned = trials[0], [t for t in trials[1:] if t.user_attrs.get("status") == "ok"]
    assert base.user_attrs["config"]["compile"] == "off" and "compile_s" not in base.user_attrs
    assert tuned
    for t in tuned:
        cfg = t.user_attrs["config"]
        assert cfg["compile"] == "default" and cfg["checkpoint"] == [[], []]
        assert t.user_attrs["activation_budget_used"] == cfg["activation_budget"]
        assert t.user_attrs["compile_s"] > 0
        assert set(t.params) >= {"compile", "budget_r0", "budget_r1"} and not any(p.startswith("ckpt") for p in t.params)
    assert study.user_attrs["autobalance:compile_total_s"] > 0
    assert "compiled trial(s) spent" in proc.stdout
    assert (tmp_path / "runs" / "s" / "inductor-cache").is_dir()  # the study's persistent cache

    proposed = [t for t in trials if t.user_attrs.get("proposed_by") == "compiled-model"]
    assert proposed, [(t.number, t.user_attrs.get("proposed_by"), t.user_attrs.get("config")) for t in trials]
    for t in proposed:
        cfg = t.user_attrs["config"]
        assert t.user_attrs["status"] == "ok" and cfg == t.user_attrs["proposed_config"]  # launched as proposed
        assert all(round(b / 0.05) * 0.05 == pytest.approx(b) for b in cfg["activation_budget"])  # the 0.05 grid
        assert len(t.user_attrs["proposal_peak_gib"]) == 2 and t.user_attrs["proposal_step_ms"] > 0
    error = study.user_attrs["autobalance:compiled_model_holdout_error"]  # each compiled trial from the others
    assert 0 <= error < 10
    assert "The compiled model proposed" in proc.stdout and "Compiled model:" in proc.stdout

    # verify a compiled trial of the study: compiled vs the script's own eager step
    number = tuned[0].number
    check = cli(["verify", MLP, "--study-name", "s", "--trial", str(number), "--storage", f"sqlite:///{db}",
                 "--runs-dir", str(tmp_path / "runs"), "--json"], cwd=tmp_path, env=FAST_COMPILE, timeout=400)
    assert check.returncode == 0, check.stderr[-3000:] + check.stdout[-2000:]
    verdict = json.loads(check.stdout)
    assert verdict["passed"] is True and verdict["config"]["compile"] == "default"
    assert {c["name"]: c for c in verdict["checks"]}["equivalence"]["grad_rel"] <= 1e-6
    assert load(db).user_attrs[f"autobalance:verify:{number}"]["passed"] is True


@pytest.fixture(scope="module")
def broken_tune(tmp_path_factory):
    """The capped study tuned with the tests/bugs ``loss-weighting`` runtime in every trial and
    verification: made once, read by the two tests below (the promote test works on a copy)."""
    root = tmp_path_factory.mktemp("broken-tune")
    db = root / "a.db"
    return cli(capped_tune_args(db, runs_dir=root / "runs"), cwd=root, env=inject("loss-weighting")), db


def _uneven(study) -> set[int]:
    """The trials whose configuration gives the ranks different numbers of samples."""
    return {t.number for t in study.trials if t.user_attrs.get("config")
            and len(set(BalanceConfig.from_dict(t.user_attrs["config"]).samples_per_rank)) > 1}


def test_tune_never_saves_what_verify_rejects(tmp_path, broken_tune):
    """Fails if tune saves a configuration verify would reject: with the loss weighting off (the
    tests/bugs ``loss-weighting`` runtime in every trial and verification) every uneven configuration
    fails verification and none is saved. An even one computes the right step even so: the reference
    run that fixes the exchange rate (the script's own split, every block checkpointed) may be saved,
    verified; when none is, the exit code and one line say so. The same study with the correct runtime
    saves a verified uneven split: test_report.py::test_tune_verified_the_best_before_saving_it (that
    study is made once for the report tests)."""
    proc, db = broken_tune
    study = load(db)
    verdicts = {int(k.rsplit(":", 1)[1]): v for k, v in study.user_attrs.items() if k.startswith("autobalance:verify:")}
    uneven = _uneven(study)
    assert verdicts and any(n in uneven for n in verdicts), (verdicts, uneven)
    assert all(not v["passed"] for n, v in verdicts.items() if n in uneven), verdicts
    assert "failed verification" in proc.stdout
    best = cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"], cwd=tmp_path)
    if proc.returncode == 0:  # an even configuration passed: saved, and only it
        saved = json.loads(best.stdout)["trial_number"]
        assert saved not in uneven and verdicts[saved]["passed"] is True, (saved, verdicts)
        return
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "No configuration was saved" in proc.stdout and "Use it in production" not in proc.stdout
    assert best.returncode != 0  # nothing in the store
    # the exit code says it, and the one error line says what to do
    assert "nothing was saved: every configuration tried failed verification" in proc.stderr
    assert "per-sample mean" in proc.stderr


def _promote(tmp_path, db, number: int, *extra: str, env=None):
    return cli(["promote", "--study-name", "s", "--trial", str(number), "--storage", f"sqlite:///{db}", *extra],
               cwd=tmp_path, env=env, timeout=400)


def test_promote_verifies_like_tune_and_never_saves_a_failed_trial(tmp_path, broken_tune):
    broken = inject("loss-weighting")
    tuned, tuned_db = broken_tune
    assert tuned.returncode in (0, 1)  # every uneven candidate failed; an even one may be saved, verified
    db = tmp_path / "a.db"
    shutil.copy(tuned_db, db)  # promote and verify write verdicts: a copy of the shared study
    study = load(db)
    assert study.user_attrs["autobalance:launch"]["script"] == GPT
    failed = [int(k.rsplit(":", 1)[1]) for k, v in study.user_attrs.items()
              if k.startswith("autobalance:verify:") and not v["passed"]]
    uneven = _uneven(study)  # with the bug only an uneven split fails verification
    failed = [n for n in failed if n in uneven]
    unverified = [t.number for t in study.trials if t.user_attrs.get("status") == "ok" and t.number in uneven
                  and f"autobalance:verify:{t.number}" not in study.user_attrs]
    if not unverified and len(failed) > 1:
        # every measured trial was a candidate (the sampler's draws decide how many are measured):
        # forget the last one's verdict in this copy, as when tune stopped before verifying it
        import sqlite3

        forget = failed.pop()
        with sqlite3.connect(db) as conn:
            conn.execute("DELETE FROM study_user_attributes WHERE key = ?", (f"autobalance:verify:{forget}",))
        study = load(db)
        unverified = [forget]
    assert failed and unverified

    # a trial that failed verification is never saved, whatever is asked
    for extra in ((), ("--no-verify",)):
        refused = _promote(tmp_path, db, failed[0], *extra)
        assert refused.returncode == 1 and "failed verification" in refused.stderr, refused.stderr
        assert "never saved" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    # an unverified trial is verified first (the script from the study); with the bug it fails
    number = unverified[0]
    bad = _promote(tmp_path, db, number, env=broken)
    assert bad.returncode == 1 and f"trial {number} of 's' failed verification" in bad.stderr, bad.stderr
    assert load(db).user_attrs[f"autobalance:verify:{number}"]["passed"] is False
    before = cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"], cwd=tmp_path)
    assert before.returncode != 0 or json.loads(before.stdout)["trial_number"] != number  # not saved

    # the script fixed: verify it again, then promote saves it, marked verified
    again = cli(["verify", GPT, "--study-name", "s", "--trial", str(number), "--storage", f"sqlite:///{db}",
                 "--runs-dir", str(tmp_path / "runs")], cwd=tmp_path, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:] + again.stdout[-2000:]
    ok = _promote(tmp_path, db, number)
    assert ok.returncode == 0 and "verified earlier" in ok.stdout, ok.stderr
    saved = json.loads(cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"],
                           cwd=tmp_path).stdout)
    assert saved["trial_number"] == number
    assert saved["figures"]["verification"]["passed"] is True


def test_promote_runs_the_verification_itself_and_no_verify_skips_it(tmp_path):
    db = tmp_path / "a.db"
    args = ["tune", MLP, "--trials", "3", "--nproc-per-node", "2", "--device", "cpu", "--storage", f"sqlite:///{db}",
            "--study-name", "s", "--strategy", "optuna", "--sampler", "random", "--seed", "0", "--trial-timeout", "120",
            "--dtypes", "fp32", "--no-verify", "--runs-dir", str(tmp_path / "runs")]
    assert cli(args, cwd=tmp_path).returncode == 0
    study = load(db)
    base = study.user_attrs["autobalance:baseline_trial"]
    others = [t.number for t in study.trials if t.user_attrs.get("status") == "ok" and t.number != base]
    assert len(others) >= 2
    ok = _promote(tmp_path, db, others[0])
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "(verified: " in ok.stdout, ok.stdout
    assert load(db).user_attrs[f"autobalance:verify:{others[0]}"]["passed"] is True
    unchecked = _promote(tmp_path, db, others[1], "--no-verify")
    assert unchecked.returncode == 0 and "not verified (--no-verify)" in unchecked.stdout, unchecked.stderr
    saved = json.loads(cli(["best", "--study-name", "s", "--storage", f"sqlite:///{db}", "--format", "json"],
                           cwd=tmp_path).stdout)
    assert saved["trial_number"] == others[1] and saved["figures"]["verification"] is None
    # a moved script: a one-line error naming --script
    moved = _promote(tmp_path, db, others[1], "--script", str(tmp_path / "gone.py"))
    assert moved.returncode == 2 and "--script=" in moved.stderr and len(moved.stderr.strip().splitlines()) == 1
