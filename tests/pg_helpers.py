"""PostgreSQL test isolation shared by the store and fault suites."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator


@contextlib.contextmanager
def throwaway_schema(server_url: str, *, prefix: str) -> Iterator[str]:
    """A URL whose tables live in a new, empty schema of their own, dropped afterwards.

    Nothing outside that schema (Optuna's tables, other tests' data) is touched.
    """
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(server_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()
