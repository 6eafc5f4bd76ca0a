"""A small real CPU study shared by the report tests, and headless Chromium for the browser tests.

The study is made once per test session by the real ``autobalance tune`` command: the GPT example
on 2 CPU ranks under a 0.0145 GiB cap, so the baseline (rank 0 holds an EMA copy and a cached
batch) runs out of memory and later trials fit. It is the capped study of
tests/test_compile_verify.py (``capped_tune_args``) with the correct runtime: test_report.py also
checks that tune verified its best before saving it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.services import service_missing
from tests.tune_helpers import capped_tune_args, cli, load

STUDY = "report-demo"
TRIALS = 4
"""The trials of ``capped_tune_args``."""


@dataclass
class SmallStudy:
    dir: Path
    db: Path
    url: str
    html: Path
    png_dir: Path
    tune_stdout: str
    report_stdout: str

    def study(self) -> Any:
        return load(self.db, STUDY)


_made: list[SmallStudy] = []


def make_small_study(tmp_path_factory: pytest.TempPathFactory) -> SmallStudy:
    """The study and its report, made once per session (test modules wrap this in a fixture)."""
    if _made:
        return _made[0]
    root = tmp_path_factory.mktemp("report-study")
    db = root / "study.db"
    tune = cli(capped_tune_args(db, study=STUDY), cwd=root)
    assert tune.returncode == 0, tune.stderr[-3000:]
    url = f"sqlite:///{db}"
    html = root / "out" / "report.html"
    rep = cli(["report", "--study-name", STUDY, "--storage", url, "-o", str(html), "--png", str(root / "png")], cwd=root)
    assert rep.returncode == 0, rep.stderr[-3000:]
    _made.append(SmallStudy(dir=root, db=db, url=url, html=html, png_dir=root / "png", tune_stdout=tune.stdout,
                            report_stdout=rep.stdout))
    return _made[0]


# ---------------------------------------------------------------------- browser
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser_or_skip() -> tuple[str, str]:
    """Paths of the Chromium binary and its driver, or skip naming what is missing."""
    browser = next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)
    driver = shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", browser), ("chromedriver (Debian: chromium-driver)", driver))
               if path is None]
    if missing:
        service_missing(f"headless browser tests need {' and '.join(missing)} on PATH: "
                        "apt-get install -y chromium chromium-driver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        service_missing("headless browser tests need the selenium package: pip install -e '.[test]'")
    assert browser is not None and driver is not None
    return browser, driver


@contextlib.contextmanager
def start_chrome() -> Iterator[Any]:
    """A headless Chromium driven by selenium (skips the test when the browser is missing)."""
    browser, driver_path = browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium-manager look for drivers online
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1600", "--hide-scrollbars", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(300)  # a loaded CI machine renders slowly; a real hang still ends
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, predicate: Any, timeout: float = 120.0) -> Any:
    """Poll ``predicate`` until it is truthy: a state of the page, never a fixed sleep (the
    generous timeout only matters on a loaded machine)."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(predicate)


def screenshot_path(repo: Path, name: str, tmp: Path) -> Path:
    """docs/<name> when AUTOBALANCE_UPDATE_SCREENSHOTS=1 (to refresh the committed ones), else tmp."""
    if os.environ.get("AUTOBALANCE_UPDATE_SCREENSHOTS") == "1":
        return repo / "docs" / name
    return tmp / name


class WsgiServer:
    """A WSGI app on 127.0.0.1:<free port> in a daemon thread (wsgiref)."""

    def __init__(self, app: Any) -> None:
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = make_server("127.0.0.1", 0, app, handler_class=Quiet)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> WsgiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
