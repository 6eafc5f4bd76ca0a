"""A production job says, in one rank-0 line, where its configuration comes from; with no stored
configuration it says it falls back to the script's own (it printed nothing). In process, no torchrun
(tests/test_production_load.py runs the same through torchrun)."""

from __future__ import annotations

import warnings

import pytest
import torch

from autobalance._config import BalanceConfig
from autobalance._errors import HardwareMismatchError
from autobalance.runtime import _choice
from autobalance.runtime._choice import choose_config
from autobalance.store import ConfigStore, current_fingerprint

DEFAULTS = BalanceConfig.uniform(world_size=2, micro_batch=4, accumulation=2)


def _choose(**overrides):
    args = dict(in_trial=False, defaults=DEFAULTS, config=None, config_file=None, study=None, storage=None,
                on_mismatch="warn", device=torch.device("cpu"), world_size=2, cap_bytes=None)
    return choose_config(**{**args, **overrides})


@pytest.fixture(autouse=True)
def _no_stored_source(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTOBALANCE_STUDY", "AUTOBALANCE_STORAGE", "AUTOBALANCE_CONFIG_FILE", "AUTOBALANCE_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def test_falling_back_to_the_scripts_defaults_is_said_once_on_rank_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert _choose() == (DEFAULTS, "defaults")
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["autobalance: using the script's own configuration (no stored configuration: set "
                     "AUTOBALANCE_STUDY and AUTOBALANCE_STORAGE, or AUTOBALANCE_CONFIG_FILE, or pass study= to "
                     "plan()): rank 0: 4,4; rank 1: 4,4 | fp32 bucket=25MB"]


def test_other_ranks_and_trials_print_nothing(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_choice.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(_choice.dist, "get_rank", lambda: 1)
    assert _choose() == (DEFAULTS, "defaults")
    assert capsys.readouterr().err == ""  # rank 1
    monkeypatch.setattr(_choice.dist, "is_initialized", lambda: False)
    assert _choose(in_trial=True) == (DEFAULTS, "defaults")  # the baseline trial: the tuner's console says it
    assert _choose(config=DEFAULTS.to_dict()) == (DEFAULTS, "argument")  # the script chose it itself
    assert capsys.readouterr().err == ""


DEMO_CAP = 15569256  # studies/gpt-cpu.toml's 0.0145 GiB
TUNED = BalanceConfig(micro_batches=[8, 8], global_batch=16, checkpoint=[[0, 1, 2, 3], []], dtype="bf16",
                      bucket_cap_mb=1.233, gradient_as_bucket_view=True)


@pytest.fixture
def demo_store(tmp_path) -> str:
    """The demo's best as `tune` saves it: 2 CPU ranks tuned under the emulated cap."""
    url = f"sqlite:///{tmp_path / 'autobalance.db'}"
    with ConfigStore(url=url) as store:
        store.save(study_name="gpt-cpu", trial_number=3, config=TUNED, figures={},
                   fingerprint=current_fingerprint(device_type="cpu", world_size=2, nnodes=1, cap_bytes=DEMO_CAP),
                   saved_by="test")
    return url


def test_a_tuned_emulated_cap_loads_in_one_line_without_a_warning(demo_store, capsys) -> None:
    """Issue 31: a production load of the demo's best (no cap in production) printed two
    HardwareMismatchWarnings, each with Python's echo of the source line; it is one line now."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        chosen, source = _choose(study="gpt-cpu", storage=demo_store, defaults=DEFAULTS)
    assert (chosen, source) == (TUNED, "store:gpt-cpu#3")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"autobalance: using study gpt-cpu, trial 3 ({demo_store}), tuned under an emulated cap of "
                     "14.8 MiB per rank; this job runs without it (the configuration fits with room to spare): "
                     "rank 0: 8 ckpt 0-3; rank 1: 8 | bf16 bucket=1MB view"]


def test_a_tighter_cap_is_still_a_mismatch_said_in_plain_lines(demo_store, capsys) -> None:
    """A real difference stays a HardwareMismatchWarning to Python's filters, printed as one plain
    line (no echo of the line that warned); under policy 'error' it stops with one line."""
    chosen, _ = _choose(study="gpt-cpu", storage=demo_store, cap_bytes=DEMO_CAP // 2)
    assert chosen == TUNED
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and lines[0].startswith("autobalance: using study gpt-cpu, trial 3"), lines
    assert all(line.startswith("autobalance: study 'gpt-cpu' (trial 3) was tuned on different hardware: rank ")
               and line.endswith("using it anyway (policy 'warn').") for line in lines[1:]), lines
    with warnings.catch_warnings():  # a script that makes warnings errors gets the mismatch as one
        warnings.simplefilter("error")
        with pytest.raises(HardwareMismatchError, match="rank 0 memory cap"):
            _choose(study="gpt-cpu", storage=demo_store, cap_bytes=DEMO_CAP // 2)
    with pytest.raises(HardwareMismatchError) as info:
        _choose(study="gpt-cpu", storage=demo_store, cap_bytes=DEMO_CAP // 2, on_mismatch="error")
    assert "\n" not in str(info.value) and "rank 0 memory cap 14.8 MiB (tuned) vs 7.42 MiB" in str(info.value)


def test_a_study_for_other_ranks_falls_back_to_the_scripts_defaults_in_one_line(demo_store, capsys) -> None:
    """Issue 31: `ab.plan(study="gpt-cpu")` in one process warned "using it anyway" and then raised a
    ConfigError with a traceback. Now: the script's own configuration, said in one line."""
    one = BalanceConfig.uniform(world_size=1, micro_batch=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _choose(study="gpt-cpu", storage=demo_store, defaults=one, world_size=1) == (one, "defaults")
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["autobalance: study 'gpt-cpu' (trial 3) was tuned for 2 rank(s), this job has 1: using the "
                     "script's own configuration instead (run the job with 2 ranks to use the study's, or tune one "
                     "with 1): rank 0: 8 | fp32 bucket=25MB"]


def test_a_study_for_other_ranks_is_refused_in_one_line_under_policy_error(demo_store, capsys) -> None:
    with pytest.raises(HardwareMismatchError) as info:
        _choose(study="gpt-cpu", storage=demo_store, world_size=1, on_mismatch="error",
                defaults=BalanceConfig.uniform(world_size=1, micro_batch=8))
    text = str(info.value)
    assert "\n" not in text and "world size 2 (tuned) vs 1 (this job)" in text
    assert text.endswith("run the job with 2 ranks, or tune a study with this job's 1 "
                         "(`autobalance tune ... --nproc-per-node`).")
    assert capsys.readouterr().err == ""
