"""Services some tests need (PostgreSQL, headless Chromium): skipped with the reason locally,
required in CI."""

from __future__ import annotations

import os

import pytest

REQUIRE_SERVICES_ENV = "AUTOBALANCE_REQUIRE_SERVICES"
"""Set to 1 (CI does, in .ci/run): a missing PostgreSQL server or headless browser fails its tests
instead of skipping them."""


def service_missing(reason: str) -> None:
    """Skip with ``reason`` (a local run without the service), or fail under
    AUTOBALANCE_REQUIRE_SERVICES=1, where CI must not go green without its services."""
    if os.environ.get(REQUIRE_SERVICES_ENV, "") not in ("", "0"):
        pytest.fail(f"{reason} ({REQUIRE_SERVICES_ENV}=1: required here)", pytrace=False)
    pytest.skip(reason)
