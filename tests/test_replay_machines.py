"""The replay's machines (``benchmarks/replay_search.py``): what it charges where the grids measured nothing.

The recorded H200 grids answer every configuration of the search space by interpolation. Three things
the replay states instead of hiding: an unmeasured compiled split with micro-steps of two sizes costs
1.5x the even splits' interpolation (the H200 ran 5,5,5,5,4,4,4 at 255-275 ms where the even splits
predicted ~185 ms); every answer names the recorded points it was read from and how (measured,
interpolated, extrapolated); and besides the recorded machine there are tilted ones (one per seed,
smooth, deterministic) and a second model family whose memory is mostly logits. A few replay studies
(seconds each) show the charges reach a real ``Tuner``'s trials.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest

from autobalance import BalanceConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import replay_search as rs  # noqa: E402  (benchmarks/ is not a package)


@pytest.fixture(autouse=True)
def _no_charts(monkeypatch: pytest.MonkeyPatch) -> None:
    import autobalance.report as report

    monkeypatch.setattr(report, "upload_trial_chart", lambda *a, **k: None)
    optuna.logging.set_verbosity(optuna.logging.ERROR)


def _compiled(acc: int, scope: str, budget: float) -> BalanceConfig:
    return BalanceConfig.any_split(rank_samples=[rs.GLOBAL_BATCH], accumulation=acc, dtype="bf16", compile="default",
                                   compile_scope=scope, activation_budget=[budget])


def _recorded(machine: rs.GridMachine, name: str) -> dict[str, Any]:
    return next(r for r in machine.rows if r["point"] == name)


def test_an_unmeasured_two_size_compiled_split_costs_one_and_a_half_times_the_even_splits() -> None:
    """Loss outside, regional at budget 1.0: 8 x 4 and 4 x 8 were measured (138.3 and 339.0 ms), so the
    even splits put 7 micro-steps at three quarters of the way between them; 5,5,5,5,4,4,4 is charged
    1.5x that, its peak as before. A measured two-size split (11,11,10 inside) keeps its measurement on
    the recorded machine; the tilted machines charge every two-size split from the even ones."""
    outside = rs.GridMachine("outside")
    as_even = rs.GridMachine("outside", two_size_factor=1.0)
    cfg = _compiled(7, "regional", 1.0)
    assert cfg.micro_step_sizes(0) == [5, 5, 5, 5, 4, 4, 4]
    eight, four = (_recorded(outside, n)["step_ms"] for n in ("regional/8/1", "regional/4/1"))
    assert as_even.point(cfg).step_ms == pytest.approx(eight + (four - eight) * 3 / 4)
    charged = outside.point(cfg)
    assert charged.step_ms == pytest.approx(1.5 * as_even.point(cfg).step_ms)
    assert charged.peak_gib == pytest.approx(as_even.point(cfg).peak_gib)
    assert "two-size x1.5" in charged.notes and charged.how == "interpolated"
    assert set(charged.basis) == {"regional/4/1", "regional/8/1"}
    even = _compiled(4, "regional", 1.0)  # an even split is not touched
    assert outside.point(even).step_ms == as_even.point(even).step_ms == _recorded(outside, "regional/8/1")["step_ms"]

    inside = rs.GridMachine("inside")
    measured = _compiled(3, "regional", 0.85)
    assert measured.micro_step_sizes(0) == [11, 11, 10]
    pt = inside.point(measured)
    assert (pt.step_ms, pt.how, pt.basis, pt.notes) == (_recorded(inside, "regional/a3/0.85")["step_ms"], "measured",
                                                        ("regional/a3/0.85",), ())
    tilted = rs.make_machine("tilted", "inside", seed=0)
    untilted = rs.GridMachine("inside", measured_two_size=False)
    assert "two-size x1.5" in untilted.point(measured).notes
    assert tilted.point(measured).step_ms == pytest.approx(
        untilted.point(measured).step_ms * tilted.tilt.factor(measured, lowest_budget=0.3))  # type: ignore[union-attr]


def test_every_answer_names_the_recorded_points_it_was_read_from() -> None:
    """A measured point names itself; one between two budgets names both; one past the measured
    micro-batches says it extrapolated; half precision other than bf16 is derived, never 'measured'."""
    outside = rs.GridMachine("outside")
    pt = outside.point(_compiled(4, "regional", 0.85))
    assert (pt.how, pt.basis) == ("measured", ("regional/8/0.85",))
    pt = outside.point(_compiled(4, "regional", 0.6))
    assert (pt.how, pt.basis) == ("interpolated", ("regional/8/0.5", "regional/8/0.7"))
    pt = outside.point(_compiled(8, "whole", 1.0))
    assert pt.how == "extrapolated" and pt.basis == ("whole/8/1",)
    fp16 = BalanceConfig.any_split(rank_samples=[32], accumulation=4, dtype="fp16", compile="default",
                                   compile_scope="regional", activation_budget=[0.85])
    assert outside.point(fp16).how == "interpolated" and "fp16 from bf16" in outside.point(fp16).notes
    eager = BalanceConfig(micro_batches=[4], accumulation=8, global_batch=32, dtype="bf16")
    assert rs.GridMachine("inside").point(eager).how == "measured"
    assert rs.GridMachine("inside").point(eager).step_ms == pytest.approx(303.529)


def test_a_tilt_is_deterministic_per_seed_smooth_and_within_its_ranges() -> None:
    """Each seed draws the same tilt every time, different seeds different ones, every draw inside the
    issue's ranges; a tilted step is the recorded one times scope factor x (m / 8) ** e x (1 + t (1 - b));
    peaks are the recorded ones; and the grid best is taken on the tilted machine."""
    tilts = [rs.Tilt.from_seed(s) for s in range(20)]
    assert tilts == [rs.Tilt.from_seed(s) for s in range(20)]
    assert len({(t.scope["whole"], t.scope["regional"], t.micro_exponent, t.budget_slope) for t in tilts}) == 20
    for t in tilts:
        assert all(0.85 <= f <= 1.15 for f in t.scope.values()) and set(t.scope) == {"whole", "regional"}
        assert -0.1 <= t.micro_exponent <= 0.1 and -0.15 <= t.budget_slope <= 0.15
    spread = [t.scope["regional"] for t in tilts]  # drawn across the range, not bunched
    assert min(spread) < 0.93 and max(spread) > 1.07
    recorded = rs.GridMachine("inside")
    for seed in (0, 3, 11):
        tilt = rs.Tilt.from_seed(seed)
        machine = rs.make_machine("tilted", "inside", seed=seed)
        for acc, scope, b in ((2, "regional", 0.5), (4, "whole", 1.0), (1, "regional", 0.5)):
            cfg = _compiled(acc, scope, b)
            m = rs.GLOBAL_BATCH // acc
            want = recorded.point(cfg).step_ms * tilt.scope[scope] * (m / 8) ** tilt.micro_exponent \
                * (1 + tilt.budget_slope * (1 - b))
            assert machine.point(cfg).step_ms == pytest.approx(want)
            assert machine.point(cfg).peak_gib == recorded.point(cfg).peak_gib
        eager = BalanceConfig(micro_batches=[4], accumulation=8, global_batch=32, dtype="bf16")
        assert machine.point(eager).step_ms == pytest.approx(recorded.point(eager).step_ms * 0.5**tilt.micro_exponent)
        low, floor = _compiled(2, "regional", 0.1), _compiled(2, "regional", 0.3)  # 0.3: the lowest measured
        assert machine.point(low).step_ms == pytest.approx(machine.point(floor).step_ms)
        ms, cfg = machine.best()
        fits = [machine.point(c).step_ms for c in machine.space() if machine.point(c).peak_gib <= machine.usable_gib]
        assert ms == min(fits)
    # seed 3 favours regional compiling: its best moved off the recorded whole-model 8 x 4 at 1.0
    moved = rs.make_machine("tilted", "inside", seed=3).best()[1]
    assert rs.label(recorded.best()[1]) == "whole 8x4 b1 bf16" and rs.label(moved) != "whole 8x4 b1 bf16"


def test_the_second_machine_is_the_recorded_one_with_four_times_the_vocabulary() -> None:
    """Every configuration: the held memory grows by the new embedding and head (20 bytes a parameter),
    the peak by three more logits shares a sample (kept bf16 logits inside a compiled loss, materialized
    ones outside it and in eager), the step by the FLOPs ratio; the cap is 30 GiB. Its best lies on a
    measured point in each placement, elsewhere than the recorded machine's."""
    fam = rs.SECOND
    assert fam.vocab_factor == 4.0 and fam.cap_gib == 30.0
    added = 2 * 3 * 32768 * 1024
    assert fam.held_gib() == pytest.approx(added * 20 / 2**30)
    assert fam.time_factor() == pytest.approx((201.3e6 + 4 * 33.55e6 + 16.8e6) / (201.3e6 + 33.55e6 + 16.8e6), rel=1e-3)
    best = {}
    for placement in ("inside", "outside"):
        recorded, second = rs.GridMachine(placement), rs.make_machine("second", placement)
        assert second.usable_gib == pytest.approx(30.0 * 0.95)
        assert second.fixed == pytest.approx(recorded.fixed + fam.held_gib())
        assert second.gradients_gib == pytest.approx(recorded.gradients_gib + added * 4 / 2**30)
        configs = [c for c in recorded.space() if c.dtype == "bf16"]
        for cfg in configs[::7]:
            m = max(cfg.micro_batches)
            kept = cfg.compile != "off" and placement == "inside"
            share = 2 * 1024 * 32768 / 2**30 + (0 if kept else 0.3125)
            r, s = recorded.point(cfg), second.point(cfg)
            assert s.peak_gib == pytest.approx(r.peak_gib + fam.held_gib() + 3 * share * m), rs.label(cfg)
            assert s.step_ms == pytest.approx(r.step_ms * fam.time_factor())
            assert s.basis == r.basis and "second family" in s.notes
        cfg = second.best()[1]
        best[placement] = (rs.label(cfg), second.point(cfg).how, rs.label(recorded.best()[1]))
    assert best == {"inside": ("regional 16x2 b1 bf16", "measured", "whole 8x4 b1 bf16"),
                    "outside": ("regional 8x4 b0.85 bf16", "measured", "regional 8x4 b0.65 bf16")}


@pytest.fixture(scope="module")
def studies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Three replay studies (5 minutes simulated, seconds here): recorded loss outside, seed 0; tilted loss inside, seed 3; second machine loss outside, seed 0."""
    import autobalance.report as report

    saved = report.upload_trial_chart
    report.upload_trial_chart = lambda *a, **k: None  # type: ignore[assignment]
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    root = str(tmp_path_factory.mktemp("replay"))
    try:
        return {kind: rs.replay(rs.make_machine(kind, placement, seed=seed), seed=seed, budget="5m", root=root)
                | {"root": root}
                for kind, placement, seed in (("recorded", "outside", 0), ("tilted", "inside", 3),
                                              ("second", "outside", 0))}
    finally:
        report.upload_trial_chart = saved  # type: ignore[assignment]


def test_a_replayed_study_is_charged_and_told_what_the_machine_knows(studies: dict[str, dict[str, Any]]) -> None:
    """Each trial names the points its answer was read from and measured what the machine answers; a
    two-size compiled trial, if any, measured what the 1.5x charge says (within the replay's 3 % noise); the saved configuration says how it was read,
    in the row and in the printed line; each machine's ratio is against its own best."""
    row = studies["recorded"]
    assert row["trial_points"] and all({"how", "basis", "notes", "phase", "config"} <= set(t) for t in row["trial_points"])
    name = "outside-5m-0"
    trials = {t.number: t for t in optuna.load_study(study_name=name, storage=f"sqlite:///{row['root']}/{name}.db").trials}
    firsts = [t for t in row["trial_points"] if not t["again"] and trials[t["trial"]].user_attrs.get("step_time_ms")]
    assert len(firsts) >= 3, row["trial_points"]
    for t in firsts:  # every trial measured what the machine answers (within the replay's noise)
        assert abs(trials[t["trial"]].user_attrs["step_time_ms"] / t["true_ms"] - 1) < 0.15, t
    # a two-size compiled trial, if the policy ran one, paid the charge
    two_size = [t for t in firsts if "two-size x1.5" in t["notes"]]
    for t in two_size:
        measured = trials[t["trial"]].user_attrs.get("step_time_ms")
        assert measured is not None and abs(measured / t["true_ms"] - 1) < 0.15, (t, measured)
        cfg = BalanceConfig.from_dict(trials[t["trial"]].user_attrs["config"])
        assert t["true_ms"] == pytest.approx(1.5 * rs.GridMachine("outside", two_size_factor=1.0).point(cfg).step_ms,
                                             rel=1e-3)
    for kind, r in studies.items():
        machine = rs.make_machine(kind, r["placement"], seed=r["seed"])
        saved = machine.point(BalanceConfig.from_dict(r["saved"]))
        assert (r["machine"], r["saved_how"], r["saved_basis"]) == (kind, saved.how, list(saved.basis))
        assert r["grid_best_ms"] == pytest.approx(machine.best()[0], abs=0.01)
        assert r["ratio"] == pytest.approx(saved.step_ms / machine.best()[0], abs=1e-3)
        line = json.loads(rs._line(r))
        assert line["saved_basis"] == r["saved_basis"] and line["saved_how"] == r["saved_how"]
    assert studies["tilted"]["tilt"] == rs.Tilt.from_seed(3).to_dict()
    assert studies["second"]["family"]["vocab"] == 131072


def test_summary_groups_by_machine(studies: dict[str, dict[str, Any]]) -> None:
    rows = list(studies.values())
    assert [(s["machine"], s["placement"]) for s in rs.summary(rows)] == [
        ("recorded", "outside"), ("tilted", "inside"), ("second", "outside")]
    assert rs.summary(rows)[0]["median_ratio"] == statistics.median([studies["recorded"]["ratio"]])


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--machines", "recorded,third", "--machines 'recorded,third': unknown third"),
    ("--seeds", "a-b", "--seeds 'a-b'"),
    ("--two-size-factor", "0", "--two-size-factor 0.0: give a positive factor"),
    ("--second-grids", "/nonexistent", "--second-grids '/nonexistent'"),
    ("--out", "/nonexistent/replay.json", "--out '/nonexistent/replay.json': its folder does not exist"),
])
def test_bad_flags_get_one_line_that_names_them(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                flag: str, value: str, says: str) -> None:
    monkeypatch.setattr(sys, "argv", ["replay_search.py", flag, value])
    with pytest.raises(SystemExit) as exc:
        rs.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in err, err


def test_a_recorded_second_family_replaces_the_derived_one(tmp_path: Path) -> None:
    """``--second-grids DIR`` (what ``benchmarks/second_family_gpu.sh`` writes: one grid per placement)
    answers from those grids as measured, at the second family's cap; here the first family's grids
    stand in for a recording, so every answer is the recorded machine's."""
    for placement, paths in rs.GRIDS.items():
        rows = [row for path in paths for row in json.loads(Path(path).read_text())["rows"]]
        (tmp_path / f"second-grid-{placement}.json").write_text(json.dumps({"rows": rows}))
    for placement in rs.GRIDS:
        recorded, second = rs.GridMachine(placement), rs.make_machine("second", placement, second_grids=str(tmp_path))
        assert second.family is None and second.name == "second" and second.cap_gib == rs.SECOND.cap_gib
        for cfg in recorded.space()[::11]:
            assert second.point(cfg) == recorded.point(cfg)


def test_the_grid_recorder_takes_another_family_by_its_script_arguments() -> None:
    """``compiled_search.py --script-arg vocab=131072`` (the second family's recording) replaces the
    study file's value; a flag the file lacks is added; a malformed one is refused with the fix."""
    import compiled_search

    args = ["--n-layer", "16", "--vocab", "32768", "--dropout", "0.0"]
    assert compiled_search.with_script_args(args, ["vocab=131072", "--samples=4096"]) == [
        "--n-layer", "16", "--vocab", "131072", "--dropout", "0.0", "--samples", "4096"]
    assert args[3] == "32768"  # not changed in place
    with pytest.raises(SystemExit, match="--script-arg 'vocab' is not NAME=VALUE"):
        compiled_search.with_script_args(args, ["vocab"])
