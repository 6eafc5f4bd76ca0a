"""The memory cap in the units people use: ``tune --memory-cap 20GiB`` / ``60MiB`` / a GPU's name, and
``--memory-cap-gib`` as before; ``diagnose`` ends with the ``tune`` line to paste."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from autobalance._errors import UsageError
from autobalance.cli import app
from autobalance.cli._report_cmds import diagnose_caps, paste_line
from autobalance.diagnose import analyse
from autobalance.launcher import TrialOutcome
from autobalance.protocol import Status
from autobalance.tuner import TuneSettings, memory_cap_text, parse_memory_cap
from autobalance.tuner._settings import GPU_MEMORY_GIB
from tests.test_diagnose import _report

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "gpt" / "train.py")
MIB = 2**20


@pytest.mark.parametrize(("text", "gib"), [
    ("20GiB", 20.0), ("60MiB", 60 / 1024), ("512KiB", 0.5 / 1024), ("1.5TiB", 1536.0), ("0.5 GiB", 0.5),
    ("40GB", 40e9 / 2**30), ("100MB", 100e6 / 2**30), ("2g", 2.0), ("60m", 60 / 1024),
    ("A100-40GB", GPU_MEMORY_GIB["A100-40GB"]), ("a100 80gb", GPU_MEMORY_GIB["A100-80GB"]),
    ("H100", GPU_MEMORY_GIB["H100-80GB"]), ("H200-141GB", GPU_MEMORY_GIB["H200"]), ("l4", GPU_MEMORY_GIB["L4"]),
])
def test_sizes_and_gpu_names(text: str, gib: float) -> None:
    assert parse_memory_cap("--memory-cap", [text]) == [pytest.approx(gib)]


def test_a_named_card_is_never_over_its_sold_size() -> None:
    """The table holds what CUDA reports (less than the size a card is sold by): a cap named after the
    card a study runs on does not exceed it."""
    for name, gib in GPU_MEMORY_GIB.items():
        sold = [int(part[:-2]) for part in name.split("-") if part.endswith("GB")]
        assert not sold or gib < sold[0], name


@pytest.mark.parametrize(("text", "words"), [
    ("20", "'20' has no unit; write 20GiB or 20MiB (or plain GiB with --memory-cap-gib 20)"),
    ("A100", "one of A100-40GB, A100-80GB"),
    ("lots", "is not a size or a GPU this table knows; use e.g. 20GiB, 60MiB or one of V100-16GB"),
    ("0MiB", "is not a positive size"),
])
def test_a_bad_cap_names_the_flag_the_value_and_the_forms(text: str, words: str) -> None:
    with pytest.raises(UsageError, match="--memory-cap=") as info:
        parse_memory_cap("--memory-cap", [text])
    assert words in str(info.value)


@pytest.mark.parametrize(("gib", "text"), [(20.0, "20GiB"), (0.06, "61.5MiB"), (72.8 / 1024, "72.8MiB"),
                                           (79.1, "79.1GiB"), (0.0005, "525KiB"), (123.4, "124GiB")])
def test_cap_text_reads_back_no_smaller(gib: float, text: str) -> None:
    assert memory_cap_text(gib) == text
    assert parse_memory_cap("--memory-cap", [text])[0] >= gib


def test_settings_take_either_flag_but_not_both() -> None:
    s = TuneSettings(script=GPT, device="cpu", memory_cap=["20GiB", "A100-40GB"])
    assert s.memory_cap_gib == [20.0, GPU_MEMORY_GIB["A100-40GB"]]
    assert s.caps_bytes() == [20 * 2**30, int(GPU_MEMORY_GIB["A100-40GB"] * 2**30)]
    assert TuneSettings(script=GPT, device="cpu", memory_cap_gib=[0.06]).memory_cap_gib == [0.06]  # as before
    with pytest.raises(UsageError, match=r"--memory-cap=20GiB and --memory-cap-gib=0\.5 both given; keep one"):
        TuneSettings(script=GPT, device="cpu", memory_cap=["20GiB"], memory_cap_gib=[0.5])
    with pytest.raises(UsageError, match="--memory-cap-gib has 3 values for 2 ranks"):
        TuneSettings(script=GPT, device="cpu", memory_cap=["1GiB", "2GiB", "3GiB"])


def _tune_settings(args: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    seen: dict[str, Any] = {}

    def fake_run_tune(*, flags: dict[str, Any], config_path: str | None) -> None:
        seen["settings"] = TuneSettings.merge(flags=flags, toml_path=config_path)

    monkeypatch.setattr("autobalance.cli._tune.run_tune", fake_run_tune)
    result = CliRunner().invoke(app, ["tune", *args])
    return result, seen.get("settings")


def test_the_command_line_and_the_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result, s = _tune_settings([GPT, "--device", "cpu", "--memory-cap", "60MiB"], monkeypatch)
    assert result.exit_code == 0, result.output
    assert s.memory_cap_gib == [pytest.approx(60 / 1024)]
    toml = tmp_path / "s.toml"
    toml.write_text(f'[tune]\nscript = "{GPT}"\ndevice = "cpu"\nmemory_cap = "14.8MiB"\n')
    result, s = _tune_settings(["--config", str(toml)], monkeypatch)
    assert result.exit_code == 0, result.output
    assert s.memory_cap_gib == [pytest.approx(14.8 / 1024)]
    toml.write_text(f'[tune]\nscript = "{GPT}"\ndevice = "cpu"\nmemory_cap_gib = 0.0145\n')
    result, s = _tune_settings(["--config", str(toml), "--memory-cap", "A100-40GB"], monkeypatch)
    assert result.exit_code == 0, result.output  # the flag replaces the file's cap, in either unit
    assert s.memory_cap_gib == [GPU_MEMORY_GIB["A100-40GB"]]
    result, s = _tune_settings([GPT, "--device", "cpu", "--memory-cap", "20"], monkeypatch)
    assert result.exit_code == 2 and "--memory-cap='20' has no unit" in result.output


def test_diagnose_caps() -> None:
    assert diagnose_caps(None, None) == (None, None)
    assert diagnose_caps("20GiB,A100-40GB", None) == ([20.0, GPU_MEMORY_GIB["A100-40GB"]], "20GiB,A100-40GB")
    assert diagnose_caps(None, "0.06") == ([0.06], "61.5MiB")
    with pytest.raises(UsageError, match="both given"):
        diagnose_caps("20GiB", "20")


def _diagnosis(device: str, peaks_mib: list[float], cap: str | None = None) -> Any:
    reports = {r: _report(r, peak=int(p * MIB)) for r, p in enumerate(peaks_mib)}
    outcome = TrialOutcome(reports=reports, status=Status.OK, reason="measured", trial_dir="/tmp/x")  # type: ignore[arg-type]
    return analyse(outcome, script="train.py", script_args=["--big"], world_size=len(peaks_mib), device=device,
                   nproc_per_node=len(peaks_mib), memory_cap=cap)


def test_the_line_to_paste() -> None:
    """The cap diagnose ran under; none on a GPU (its own memory); on CPU the smallest cap the script's
    own configuration fits under with the 5 % headroom, which tune then reads back."""
    what, command = paste_line(_diagnosis("cpu", [72.8, 40.0], cap="60MiB"), cap_text="60MiB")
    assert command == "autobalance tune train.py --nproc-per-node 2 --device cpu --memory-cap 60MiB -- --big"
    what, command = paste_line(_diagnosis("cuda", [72.8, 40.0]), cap_text=None)
    assert command == "autobalance tune train.py --nproc-per-node 2 --device cuda -- --big"
    assert "--memory-cap A100-40GB" in what
    what, command = paste_line(_diagnosis("cpu", [72.8, 40.0]), cap_text=None)
    assert command == "autobalance tune train.py --nproc-per-node 2 --device cpu --memory-cap 76.7MiB -- --big"
    assert "72.8 MiB" in what and "5%" in what
    usable = parse_memory_cap("--memory-cap", ["76.7MiB"])[0] * 0.95 * 1024
    assert 72.8 <= usable < 72.9  # the script's own largest peak just fits


def test_the_studys_first_lines_name_the_card() -> None:
    from autobalance.tuner._reporter import cap_line

    named = cap_line(TuneSettings(script=GPT, device="cpu", memory_cap=["A100-40GB"]))
    assert named is not None and named.startswith("Emulated memory cap (A100-40GB): 39.3 GiB per rank"), named
    sized = cap_line(TuneSettings(script=GPT, device="cpu", memory_cap=["60MiB"]))
    assert sized is not None and sized.startswith("Emulated memory cap: 60.0 MiB per rank"), sized
