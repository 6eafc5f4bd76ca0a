"""The ``autobalance`` command (thin: parsing and printing; the work lives in the rooms)."""

from __future__ import annotations

from autobalance.cli._app import app, main

__all__ = ["app", "main"]
