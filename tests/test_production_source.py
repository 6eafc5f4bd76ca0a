"""A production job says, in one rank-0 line, where its configuration comes from; with no stored
configuration it says it falls back to the script's own (it printed nothing). In process, no torchrun
(tests/test_production_load.py runs the same through torchrun)."""

from __future__ import annotations

import pytest
import torch

from autobalance._config import BalanceConfig
from autobalance.runtime import _choice
from autobalance.runtime._choice import choose_config

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
                     "plan()): micro-batches per optimizer step rank 0: 4,4; rank 1: 4,4"]


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
