"""The study's side of verification: which trials to verify before saving (``tune``), and the
``autobalance verify`` command. The rule itself and its runs are the :mod:`autobalance.verify` room.

**Promote.** Saving a trial's configuration to the store (end of ``tune`` and ``autobalance promote``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from autobalance._config import BalanceConfig
from autobalance._errors import UsageError, VerificationError
from autobalance._files import script_sha256
from autobalance.launcher import WarmPool
from autobalance.protocol import Status, StudyAttr, TrialAttr, best_trial, ranked_trials
from autobalance.tuner._remeasure import one_per_config, saved_spread
from autobalance.tuner._reporter import write_notes
from autobalance.tuner.search import MAX_CANDIDATES, cache_dir, compile_env
from autobalance.verify import Failure, SharedRuns, Verification, Verifier, VerifyTarget

__all__ = ["figures_of_trial", "promote_trial", "ranked_candidates", "run_verify_command", "save_trial",
           "verify_for_saving"]


# ---------------------------------------------------------------------- in the study
def _work_dir(runs_dir: str, study_name: str, label: str) -> str:
    return os.path.join(runs_dir, study_name, f"verify-{label}-{int(time.time())}")


def _config_of(trial: Any) -> BalanceConfig:
    return BalanceConfig.from_dict(trial.user_attrs[TrialAttr.CONFIG])


def _has_config(trial: Any) -> bool:
    return trial is not None and bool(trial.user_attrs.get(TrialAttr.CONFIG))


def _verdict(study: Any, number: int | str) -> Any:
    return study.user_attrs.get(f"{StudyAttr.VERIFY_PREFIX}{number}")


def _keep_verdict(study: Any, number: int | str, verdict: Verification) -> None:
    study.set_user_attr(f"{StudyAttr.VERIFY_PREFIX}{number}", verdict.to_dict())
    write_notes(study)  # the best trial's dashboard note gives the verdict


def allows_batch_dependent(study: Any) -> bool:  # --allow-batch-dependent
    return bool(study.user_attrs.get(StudyAttr.ALLOW_BATCH_DEPENDENT, False))


def ranked_candidates(study: Any) -> list[Any]:
    """The candidates for the best (``protocol.ranked_trials``: one meaning of best), one per configuration."""
    return one_per_config(ranked_trials(study))


def verify_for_saving(*, settings: Any, study: Any, best: Any, baseline: Any, notes: list[str],
                      note: Callable[[str], None] | None = None, pool: WarmPool | None = None) -> Any:
    """The trial to save: ``best`` if it passes verification, else the next best that does (up to
    :data:`MAX_CANDIDATES`); None when none does. Each verdict is kept as a study attribute, so a
    continued study does not verify the same trial twice. ``pool``: the study's (the caller closes it)."""
    if settings.nnodes > 1:
        notes.append("Verification skipped (multi-node study): run `autobalance verify` on one node before "
                     "training with the saved configuration.")
        return best
    baseline_cfg = _config_of(baseline) if _has_config(baseline) else None
    allow = allows_batch_dependent(study)
    candidates = [best] + [t for t in ranked_candidates(study) if t.number != best.number]
    with SharedRuns(pool=pool) as shared:  # one pool and one run of each baseline for every candidate

        def verify(trial: Any) -> Verification:  # the tune run's script, ranks, device, cache
            s = settings
            target = VerifyTarget(
                script=s.script, script_args=list(s.script_args), nproc_per_node=s.nproc_per_node, device=s.device,
                torchrun_args=list(s.torchrun_args), timeout_s=s.trial_timeout, cold=s.cold, env=compile_env(s),
                work_dir=os.path.abspath(_work_dir(s.runs_dir, s.study_name, f"trial{trial.number}")))
            verifier = Verifier(target, note=note, shared=shared, allow_batch_dependent=allow)
            verdict = verifier.verify(_config_of(trial), baseline=baseline_cfg)
            _keep_verdict(study, trial.number, verdict)
            if verdict.passed and not verdict.skipped:
                notes.append(f"Verified trial {trial.number}: {verdict.reason} ({verdict.wall_s:.0f} s).")
            elif not verdict.passed:
                notes.append(f"Not saved: trial {trial.number} failed verification: {verdict.reason}.")
            return verdict

        tried = split_failures = 0  # split_failures: a split not the script's whose fp32 math failed
        for trial in candidates:
            if tried >= MAX_CANDIDATES:
                break
            previous = _verdict(study, trial.number)
            if previous is not None:
                if not previous.get("passed"):
                    continue  # failed before: never saved
                return trial
            tried += 1
            verdict = verify(trial)
            if verdict.passed:
                return trial
            if (verdict.failure is Failure.MATH and baseline_cfg is not None
                    and not same_split(_config_of(trial), baseline_cfg)):
                split_failures += 1
        if baseline_cfg is None or split_failures == 0 or split_failures < tried:
            return None
        # every candidate's split changed the step: a term over the micro-batch (a balancing loss, a
        # batch statistic autobalance cannot see) - keep the script's own split, as for BatchNorm
        kept = [t for t in ranked_candidates(study)
                if same_split(_config_of(t), baseline_cfg) and _verdict(study, t.number) is None]
        if not kept:
            notes.append("Every verified split changed the fp32 step far above rounding, and no feasible trial keeps "
                         f"the script's own split ({baseline_cfg.split_text()}): tune again with the split fixed.")
            return None
        trial = kept[0]
        notes.append(f"Every verified split other than the script's changed the fp32 step far above rounding (a loss "
                     "that is not a per-sample mean, or a term computed over the whole micro-batch such as a "
                     "load-balancing loss); kept the script's own split "
                     f"({baseline_cfg.split_text()}) with the best other settings (trial {trial.number}), as for "
                     "BatchNorm.")
        return trial if verify(trial).passed else None


def same_split(a: BalanceConfig, b: BalanceConfig) -> bool:
    """Whether ``a`` and ``b`` give every rank the same micro-batches (sizes, accumulation)."""
    return a.world_size == b.world_size and all(a.micro_step_sizes(r) == b.micro_step_sizes(r)
                                                for r in range(a.world_size))


# ---------------------------------------------------------------------- the command
def load_config_file(path: str) -> BalanceConfig:
    """A configuration file: a BalanceConfig JSON object or a file written by ``autobalance export``."""
    try:
        with open(path) as fh:
            text = fh.read(2_000_000)
    except OSError as exc:
        raise UsageError(f"--config={path!r} cannot be read ({exc.strerror or exc}); pass a configuration JSON file.") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise UsageError(f"--config={path!r} is not JSON; pass a file written by `autobalance export`.") from None
    if isinstance(data, dict) and "config" in data and isinstance(data["config"], dict):
        data = data["config"]
    return BalanceConfig.from_dict(data)


def run_verify_command(*, script: str, script_args: list[str], study_name: str | None, storage: str,
                       trial: int | None, config_file: str | None, nproc_per_node: int | None, device: str | None,
                       runs_dir: str, trial_timeout: float, cold: bool,
                       note: Callable[[str], None] | None = None) -> tuple[Verification, BalanceConfig, str]:
    """Verify a study's best trial (or ``trial``), or the configuration in ``config_file``: the verdict,
    the configuration and what it was."""
    if not script.endswith(".py") or not os.path.isfile(script):
        raise UsageError(f"SCRIPT={script!r} is not an existing Python file; pass the training script the study tuned.")
    if trial is not None and config_file is not None:
        raise UsageError("--trial and --config both given; verify either a study's trial or a configuration file.")
    if config_file is None and study_name is None:
        raise UsageError("nothing to verify: pass --study-name (its best trial, or --trial N) or --config FILE.")
    if trial is not None and trial < 0:
        raise UsageError(f"--trial={trial} is negative; pass a trial number of the study.")
    study = None
    env: dict[str, str] = {}
    if config_file is not None:
        config, what, label = load_config_file(config_file), f"the configuration in {config_file}", "file"
    else:
        from autobalance.store import load_study

        study = load_study(study_name=str(study_name), storage_url=storage)
        trials = study.get_trials(deepcopy=False)
        if trial is not None and (trial >= len(trials) or not _has_config(trials[trial])):
            raise UsageError(f"--trial={trial} is not a trial of {study_name!r} with a configuration; list them "
                             f"with `autobalance trials --study-name {study_name}`.")
        chosen = trials[trial] if trial is not None else best_trial(study)
        if chosen is None:
            raise UsageError(f"study {study_name!r} has no feasible trial yet; pass --trial N or run more trials.")
        config, label = _config_of(chosen), f"trial{chosen.number}"
        what = f"trial {chosen.number} of '{study_name}'"
        device = device or (study.user_attrs.get(StudyAttr.DEVICE) or {}).get("type")
        if config.compile != "off" and not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir(runs_dir, str(study_name)),  # its own
                   "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    nproc = nproc_per_node or config.world_size
    if nproc != config.world_size:
        raise UsageError(f"--nproc-per-node={nproc} but {what} has {config.world_size} ranks; verify on one node "
                         f"with --nproc-per-node {config.world_size}.")
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device={device!r} is unknown; use cpu or cuda.")
    work = os.path.abspath(_work_dir(runs_dir, study_name or "verify", label))
    target = VerifyTarget(script=script, script_args=script_args, nproc_per_node=nproc, device=device,
                          timeout_s=trial_timeout, work_dir=work, cold=cold, env=env)
    allow = allows_batch_dependent(study) if study is not None else False
    verdict = Verifier(target, note=note, allow_batch_dependent=allow).verify(config)  # always run, even the script's own
    if study is not None:
        _keep_verdict(study, label[len("trial"):], verdict)
    return verdict, config, what


# ----------------------------------------------------------------------- verify and save one trial
_FIGURE_KEYS = ("peak_device_gib", "peak_reserved_gib", "peak_allocated_gib", "outside_pytorch_gib",
                "capacity_gib", "spread_gib", "spread_pct_of_capacity", "step_time_ms", "step_time_iqr_pct",
                "samples_per_s", "status")


def figures_of_trial(study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
    figures: dict[str, Any] = {k: trial.user_attrs.get(k) for k in _FIGURE_KEYS}
    figures["values"] = trial.values
    if (spread := saved_spread(study, trial)) is not None:  # pooled when leaders were re-measured
        figures["step_time_spread"] = spread
    verdict = _verdict(study, trial.number)
    figures["verification"] = None if verdict is None else {
        k: verdict.get(k) for k in ("passed", "reason", "skipped")}
    base_no = study.user_attrs.get(StudyAttr.BASELINE)
    if base_no is not None:
        base = study.trials[base_no]
        figures["baseline"] = {k: base.user_attrs.get(k) for k in _FIGURE_KEYS} | {"trial": base_no}
        base_ms, ms = base.user_attrs.get(TrialAttr.STEP_TIME_MS), trial.user_attrs.get(TrialAttr.STEP_TIME_MS)
        if base_ms and ms:
            figures["speedup_vs_baseline"] = round(base_ms / ms, 4)
    return figures


def fingerprint_of_study(study: optuna.Study, trial: FrozenTrial) -> Any:
    """The tuning job's hardware: devices (each rank's identity, which production maps the
    configuration by), memory, versions, and each rank's busy ms per sample in ``trial``."""
    from autobalance.store import HardwareFingerprint

    objective = study.user_attrs.get(StudyAttr.OBJECTIVE, {})
    device = study.user_attrs.get(StudyAttr.DEVICE, {})
    world = int(objective.get("world_size", 1))
    caps = objective.get("caps_bytes") or [None] * world
    capacity = [int(c) for c in study.user_attrs.get(StudyAttr.CAPACITY, [])] or [0] * world
    names = study.user_attrs.get(StudyAttr.DEVICE_NAMES) or []
    speeds: list[float | None] = []
    busy = trial.user_attrs.get(TrialAttr.BUSY_MS)
    if isinstance(busy, list) and len(busy) == world and TrialAttr.CONFIG in trial.user_attrs:
        samples = _config_of(trial).samples_per_rank
        speeds = [None if b is None else round(b / n, 4) for b, n in zip(busy, samples, strict=True)]
    return HardwareFingerprint(
        device_names=[str(n) for n in names] if len(names) == world and all(names) else [],
        ms_per_sample=speeds, device_type=device.get("type", objective.get("device", "cpu")),
        device_name=device.get("name", "unknown"), capacity_bytes=capacity, cap_bytes=list(caps),
        world_size=world, nnodes=int(objective.get("nnodes", 1)),
        torch_version=str(study.user_attrs.get(StudyAttr.TORCH_VERSION) or ""),
        cuda_version=study.user_attrs.get(StudyAttr.CUDA_VERSION))


def save_trial(*, storage_url: str, study: optuna.Study, trial_number: int, action: str) -> Any:
    """Save the trial's configuration as the study's current best; returns the SavedConfig."""
    from autobalance.store import ConfigStore, make_saved_by

    trial = _measured_trial(study, trial_number)
    with ConfigStore(url=storage_url) as store:
        return store.save(
            study_name=study.study_name, trial_number=trial_number, config=_config_of(trial),
            figures=figures_of_trial(study, trial), fingerprint=fingerprint_of_study(study, trial),
            script_sha256=str(study.user_attrs.get(StudyAttr.SCRIPT_SHA, "")),
            saved_by=make_saved_by(action))


def promote_trial(*, storage_url: str, study: optuna.Study, trial_number: int, verify: bool = True,
                  script: str | None = None, script_args: list[str] | None = None,
                  note: Callable[[str], None] | None = None) -> tuple[Any, str]:
    """``autobalance promote``: save a chosen trial as the study's best, verified first like the end of
    ``tune`` (``verify=False`` skips a trial not verified yet); ``script``/``script_args`` default to how
    the study's latest ``tune`` ran it. Returns the SavedConfig and one line on the verification."""
    trial = _measured_trial(study, trial_number)
    previous = _verdict(study, trial_number)
    if previous is not None and not previous.get("passed"):
        raise VerificationError(
            f"trial {trial_number} of {study.study_name!r} failed verification ({previous.get('reason')}); a configuration "
            "that fails is never saved. Promote another trial (`autobalance trials --study-name "
            f"{study.study_name}`), or, if the script was fixed since, verify it again with `autobalance verify SCRIPT "
            f"--study-name {study.study_name} --trial {trial_number}`.")
    if previous is not None:
        line = f"verified earlier: {previous.get('reason')}"
    elif not verify:
        line = "not verified (--no-verify)"
    else:
        verdict = _verify_trial(study, trial, script=script, script_args=script_args, note=note)
        _keep_verdict(study, trial_number, verdict)
        if not verdict.passed:
            raise VerificationError(f"trial {trial_number} of {study.study_name!r} failed verification: {verdict.reason}; "
                                    "it is not saved. Promote another trial.")
        line = f"verified: {verdict.reason} ({verdict.wall_s:.0f} s)"
    return save_trial(storage_url=storage_url, study=study, trial_number=trial_number, action="promote"), line


def _verify_trial(study: optuna.Study, trial: FrozenTrial, *, script: str | None, script_args: list[str] | None,
                  note: Callable[[str], None] | None) -> Any:
    launch = dict(study.user_attrs.get(StudyAttr.LAUNCH) or {})
    script = script or launch.get("script")
    if not script:
        raise UsageError(f"study {study.study_name!r} does not record its training script (tuned before autobalance "
                         "kept it); pass --script PATH, or --no-verify to save without verification.")
    if not os.path.isfile(script):
        raise UsageError(f"--script={script!r} is not a file; pass the training script the study tuned, or --no-verify.")
    tuned_sha = study.user_attrs.get(StudyAttr.SCRIPT_SHA)
    if tuned_sha and script_sha256(script) != tuned_sha:
        raise UsageError(f"--script={script!r} differs from the script the study tuned (sha256); pass that script, "
                         "or --no-verify to save without verification.")
    base_no = study.user_attrs.get(StudyAttr.BASELINE)
    base = study.trials[base_no] if base_no is not None else None
    baseline = _config_of(base) if _has_config(base) else None
    config = _config_of(trial)
    runs_dir = str(launch.get("runs_dir") or "autobalance_runs")
    device = launch.get("device") or (study.user_attrs.get(StudyAttr.DEVICE) or {}).get("type") or "cpu"
    target = VerifyTarget(
        script=script, script_args=list(script_args if script_args is not None else launch.get("script_args") or []),
        nproc_per_node=int(launch.get("nproc_per_node") or config.world_size), device=str(device),
        torchrun_args=list(launch.get("torchrun_args") or []), timeout_s=float(launch.get("trial_timeout") or 300),
        work_dir=_work_dir(runs_dir, study.study_name, f"trial{trial.number}"),
        cold=bool(launch.get("cold", False)), env=dict(launch.get("compile_env") or {}))
    return Verifier(target, note=note, allow_batch_dependent=allows_batch_dependent(study)).verify(config, baseline=baseline)


def _measured_trial(study: optuna.Study, trial_number: int) -> FrozenTrial:
    trials = study.get_trials(deepcopy=False)
    if not 0 <= trial_number < len(trials):
        raise UsageError(
            f"--trial={trial_number} is not a trial of study {study.study_name!r} (it has trials 0..{len(trials) - 1}); "
            f"list them with `autobalance trials --study-name {study.study_name}`.")
    trial = trials[trial_number]
    if TrialAttr.CONFIG not in trial.user_attrs or trial.user_attrs.get(TrialAttr.STATUS) != Status.OK:
        raise UsageError(f"--trial={trial_number} has no measured configuration (status "
                         f"{trial.user_attrs.get('status')!r}); promote a trial whose status is ok.")
    return trial
