"""optuna-dashboard over a study database, with the artifact store that holds the per-trial charts."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from autobalance.report._artifacts import artifact_dir_for

__all__ = ["dashboard_app", "serve_dashboard"]


def dashboard_app(storage_url: str) -> Any:
    """optuna-dashboard's WSGI application for ``storage_url`` and its artifact directory."""
    try:
        import optuna_dashboard
    except ImportError:
        from autobalance._errors import UsageError

        raise UsageError("the dashboard needs optuna-dashboard; install it with pip install 'autobalance[report]'.") from None
    from optuna.artifacts import FileSystemArtifactStore

    from autobalance.tuner import open_storage

    storage = open_storage(storage_url, heartbeat=False)
    art_dir = artifact_dir_for(storage_url)
    os.makedirs(art_dir, exist_ok=True)
    return optuna_dashboard.wsgi(storage, artifact_store=FileSystemArtifactStore(art_dir))


def serve_dashboard(storage_url: str, *, host: str = "127.0.0.1", port: int = 8080,
                    echo: Callable[[str], None] = print) -> None:
    """Serve the dashboard until interrupted (wsgiref, as ``optuna_dashboard.run_server`` does)."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from autobalance._errors import UsageError
    from autobalance.tuner._storage import mask

    app = dashboard_app(storage_url)

    class _Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    try:
        server = make_server(host, port, app, handler_class=_Quiet)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port.") from None
    shown = f"[{host}]" if ":" in host else host
    echo(f"optuna-dashboard for {mask(storage_url)} at http://{shown}:{server.server_port}/dashboard "
         f"(artifacts in {artifact_dir_for(storage_url)}). Ctrl-C to stop.")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
