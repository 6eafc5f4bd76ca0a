"""``autobalance tune``: settings, the study, the final comparison and where things live."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from autobalance._errors import UsageError


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_gpus(settings: Any) -> None:
    if settings.device != "cuda":
        return
    import torch

    visible = torch.cuda.device_count()
    if visible == 0:
        raise UsageError("--device=cuda but no CUDA device is visible; use --device cpu.")
    if settings.nproc_per_node > visible:
        raise UsageError(
            f"--nproc-per-node={settings.nproc_per_node} is larger than the {visible} visible GPU(s); "
            f"use at most {visible} or check CUDA_VISIBLE_DEVICES."
        )


def run_tune(*, flags: dict[str, Any], config_path: str | None) -> None:
    from autobalance.tuner import RichReporter, TuneSettings, Tuner
    from autobalance.tuner._storage import open_storage

    if flags.get("device") is None and not (config_path and "device" in _toml_keys(config_path)):
        flags["device"] = _default_device()
    settings = TuneSettings.merge(flags=flags, toml_path=config_path)
    quiet_optuna()
    _check_gpus(settings)
    from autobalance._errors import StorageError
    from autobalance.store import check_storage

    try:
        settings.storage = check_storage(settings.storage)
    except StorageError as exc:
        raise type(exc)(f"--storage: {exc}") from None  # fail before any trial when the storage is unusable
    open_storage(settings.storage)
    console = Console(stderr=True)
    reporter = RichReporter(console=console)
    tuner = Tuner(settings=settings, reporter=reporter)
    try:
        result = tuner.run()
    finally:
        reporter.end()
    if result.best is not None:
        from autobalance.tuner._promote import save_trial
        from autobalance.tuner._storage import load_study

        study = load_study(study_name=settings.study_name, storage_url=settings.storage)
        save_trial(storage_url=settings.storage, study=study, trial_number=result.best.number, action="tune")
        result.saved = True
        result.notes.append(f"Saved trial {result.best.number} as the best configuration of '{settings.study_name}'.")
    from autobalance.cli._views import print_result

    print_result(result, settings=settings, console=Console())


def _toml_keys(path: str) -> set[str]:
    from autobalance.tuner import load_toml

    return {k for k in load_toml(path)}


def quiet_optuna() -> None:
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
