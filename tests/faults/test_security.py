"""Security: storage passwords never leak; configurations reaching a training process are JSON,
validated, never unpickled or evaluated; the dashboard listens on 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from autobalance import BalanceConfig, ConfigError
from autobalance.launcher import TrialLaunch, run_trial, trial_environment
from tests.faults.conftest import (
    assert_no_processes,
    env_for,
    load,
    run_cli,
    tune,
    wait_for,
)
from tests.tune_helpers import FAULTY

PASSWORD = "s3cret"


@pytest.mark.slow
@pytest.mark.postgres
def test_storage_password_never_appears(tmp_path: Path, postgres_server: str, pg_study: str) -> None:
    """A PostgreSQL URL with a password (trust auth ignores it) through tune, studies, trials, best
    and an error: not in any output, log, report, artifact, study/trial attribute or store row."""
    from sqlalchemy import create_engine, text

    url = make_url(postgres_server).set(password=PASSWORD).render_as_string(hide_password=False)
    assert PASSWORD in url
    env = env_for(tmp_path, AUTOBALANCE_STORAGE=url)  # also in the tuner's environment
    outputs = []
    proc = tune(url, cwd=tmp_path, trials=1, study=pg_study, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:].replace(PASSWORD, "<leaked>")
    assert "***" in proc.stdout  # the URL is shown, masked
    outputs.append(proc.stdout + proc.stderr)
    for args in (["studies"], ["trials", "--study-name", pg_study], ["best", "--study-name", pg_study],
                 ["trials", "--study-name", "nope"]):
        run = run_cli([sys.executable, "-m", "autobalance", *args, "--storage", url], cwd=tmp_path, env=env)
        assert run.returncode == (2 if "nope" in args else 0), run.stderr[-2000:].replace(PASSWORD, "<leaked>")
        outputs.append(run.stdout + run.stderr)
    for text_ in outputs:
        assert PASSWORD not in text_
    leaked = [str(p) for p in tmp_path.rglob("*") if p.is_file() and PASSWORD.encode() in p.read_bytes()]
    assert leaked == [], f"password written to {leaked}"
    study = load(url, pg_study)
    blobs = [json.dumps(study.user_attrs, default=str), json.dumps(study._storage.get_study_system_attrs(study._study_id), default=str)]
    for t in study.trials:
        blobs += [json.dumps(t.user_attrs, default=str), json.dumps(t.system_attrs, default=str)]
    engine = create_engine(postgres_server)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT * FROM autobalance_saved_config WHERE study_name = :n"),
                                {"n": pg_study}).all()
    finally:
        engine.dispose()
    assert rows, "tune saved no best configuration"
    blobs += [repr(tuple(r)) for r in rows]
    assert not [b for b in blobs if PASSWORD in b]


def test_trial_processes_never_see_the_storage_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AUTOBALANCE_STORAGE", f"postgresql+psycopg://u:{PASSWORD}@db/x")
    monkeypatch.setenv("AUTOBALANCE_STUDY", "s")
    env = trial_environment(TrialLaunch(script=FAULTY, nproc_per_node=2, trial_dir=str(tmp_path)))
    assert "AUTOBALANCE_STORAGE" not in env and "AUTOBALANCE_STUDY" not in env
    assert not [k for k, v in env.items() if PASSWORD in v]


def _pickle_payload(marker: Path) -> str:
    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    return base64.b64encode(pickle.dumps(Evil())).decode()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ('{"micro_batches": [2, 2], "global_batch": 4, "dtype": "__import__(\'os\').system(\'touch {marker}\')"}',
         "dtype="),
        ("PICKLE", "configuration JSON is malformed"),
    ],
    ids=["python-expression", "pickle"],
)
def test_malicious_config_from_the_environment_is_rejected_with_an_error_report(
        tmp_path: Path, payload: str, words: str) -> None:
    """A real torchrun trial whose AUTOBALANCE_CONFIG is hostile: the ranks reject it (JSON, validated)
    and write ``error`` reports (at least the first to fail); nothing is evaluated or unpickled."""
    marker = tmp_path / "PWNED"
    config = _pickle_payload(marker) if payload == "PICKLE" else payload.replace("{marker}", str(marker))
    launch = TrialLaunch(script=FAULTY, nproc_per_node=2, trial_dir=str(tmp_path / "trial"), config_json=config,
                         timeout_s=90, steps=2, warmup=1, env={"OMP_NUM_THREADS": "1"})
    outcome = run_trial(launch)
    assert outcome.status == "error", outcome.reason
    assert "ConfigError" in outcome.reason and words in outcome.reason
    # torchrun stops the other rank once one has failed: on a busy machine the slower one can be
    # stopped before it writes its report (CI once lost rank 1's), so every report written is checked
    written = [tmp_path / "trial" / f"rank{rank}.json" for rank in (0, 1)]
    reports = [json.loads(path.read_text()) for path in written if path.exists()]
    assert reports, "no rank wrote its error report"
    for report in reports:
        assert report["status"] == "error" and "ConfigError" in report["error"]
    assert not marker.exists()
    assert_no_processes(tmp_path)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,  # nesting that exhausts the parser
        '{"micro_batches": [2, 2], "global_batch": 4, "bucket_cap_mb": NaN}',
        '{"micro_batches": [2, 2], "global_batch": 4, "__class__": "os.system"}',
        '{"micro_batches": [1, 1, 1], "global_batch": 3, "checkpoint": [[-1], [], []]}',
        '{"micro_batches": [2147483647, 2147483647], "global_batch": 4294967294}',
        '{"micro_batches": [2, 2], "global_batch": 4, "gradient_as_bucket_view": "yes"}',
        " " * 2_000_000,
    ],
    ids=["deep-nesting", "nan", "unknown-field", "negative-block", "huge-batch", "wrong-type", "huge-text"],
)
def test_config_json_is_validated(text: str) -> None:
    with pytest.raises(ConfigError):
        BalanceConfig.from_json(text)


@pytest.mark.slow
def test_dashboard_listens_on_localhost_by_default(tmp_path: Path, seeded: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "autobalance", "dashboard", "--storage", seeded, "--port", str(port)],
                            cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        def listening() -> list[str]:
            if proc.poll() is not None:
                raise AssertionError(f"dashboard exited: {proc.communicate()[1][-2000:]}")
            return [addr for addr in _listening_addresses() if addr.endswith(f":{port:04X}")]

        addresses = wait_for(listening, timeout=60, what="the dashboard to listen")
        assert addresses == [f"0100007F:{port:04X}"], addresses  # 127.0.0.1 only
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=30)


def _listening_addresses() -> list[str]:
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                out.append(fields[1])
    return out
