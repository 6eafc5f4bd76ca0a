"""``autobalance tune``: flags to settings, the tuner (its preflight, the study, verify-and-save), the summary."""

from __future__ import annotations

from typing import Any

from autobalance.cli._common import console, quiet_optuna, sigterm_as_interrupt


def interrupted_message(settings: Any) -> str:
    """After Ctrl-C: what happened, the best trial so far and how to keep it (one line)."""
    from autobalance._config import describe_config
    from autobalance.protocol import memory_text, trial_ranks
    from autobalance.store import mask_url
    from autobalance.tuner import best_so_far

    text = "interrupted; the running trial was killed and marked failed."
    best = best_so_far(study_name=settings.study_name, storage_url=settings.storage)
    if best is None:
        text += " No feasible trial yet."
    else:
        a = best.user_attrs
        figures = ", ".join(f for f in (
            f"step {a['step_time_ms']:.1f} ms" if a.get("step_time_ms") is not None else "",
            f"spread {memory_text(a['spread_gib'])}" if a.get("spread_gib") is not None and trial_ranks(a) > 1 else "")
            if f)
        text += (f" Best so far: trial {best.number} ({describe_config(a.get('config'))}; {figures}); keep it with "
                 f"`autobalance promote --study-name {settings.study_name} --trial {best.number} --storage "
                 f"{mask_url(settings.storage)}` (verifies, then saves), or")
    return text + " run the same command again to continue the study."


def run_tune(*, flags: dict[str, Any], config_path: str | None) -> None:
    """Settings (flags > study TOML > defaults; the TOML is read once), checks before anything runs,
    the study, then verify-and-save (:func:`autobalance.tuner.save_best`) and the summary."""
    from autobalance.tuner import RichReporter, Tuner, TuneSettings, preflight, save_best

    settings = TuneSettings.merge(flags=flags, toml_path=config_path)
    quiet_optuna()
    tuner: Tuner | None = None
    try:
        with preflight(settings):  # nothing runs unless the host, the runs directory and the storage are usable
            sigterm_as_interrupt()
            reporter = RichReporter(console=console(stderr=True))
            tuner = Tuner(settings=settings, reporter=reporter, keep_pool=True)  # verification runs in its workers
            try:
                result = tuner.run()
            except KeyboardInterrupt:
                raise KeyboardInterrupt(interrupted_message(settings)) from None
            finally:
                reporter.end()
        saving = save_best(settings=settings, result=result, note=reporter.note, pool=tuner.kept_pool)
    finally:
        if tuner is not None:  # no worker outlives the command, whatever ended it
            tuner.close_kept_pool()
    from autobalance.cli._views import print_result

    print_result(result, settings=settings, console=console(), nothing_feasible=saving.nothing_feasible,
                 rejected=saving.rejected)
    saving.check()
