"""`gptkit watch`: a small app of its own (no model, no engine) that serves a training run's live page and the
run's records, read from its directory only.

GET /api/run answers with what was appended since the client's cursor rather than the whole run: a long run's
metrics.jsonl grows to megabytes (a line per logged step) and insight.jsonl by a position-loss row per evaluation,
while the page asks every second; what changes between two asks is a few lines.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from gptkit.errors import GptkitError, InputError
from gptkit.observe.run_reader import read_run
from gptkit.serving.middleware import HostGuard
from gptkit.serving.schemas import error_body

STATIC = Path(__file__).parent / "static"


def create_watch_app(run_dir: Path, allowed_hosts: tuple[str, ...] | None = ()) -> FastAPI:
    """The app showing run_dir. allowed_hosts: the Host names answered besides loopback ones (None: any, for a
    server bound to a non-loopback address)."""
    app = FastAPI(title="gptkit watch", docs_url=None, redoc_url=None, openapi_url=None)
    if allowed_hosts is not None:  # a rebound DNS name must not read the run through the user's browser
        app.add_middleware(HostGuard, allowed=allowed_hosts)

    @app.get("/api/run")
    async def run(since: str | None = None) -> JSONResponse:
        try:
            body = await asyncio.to_thread(read_run, run_dir, since)  # a first read may be megabytes
        except InputError as err:
            return JSONResponse(error_body(str(err), param="since", code="invalid_value"), status_code=400)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "watch.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one, which the caller can then print); a one-line error when
    it cannot be had."""
    if not 0 <= port <= 65535:
        raise GptkitError(f"--port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed server's port is free
    try:
        sock.bind((host, port))
        sock.listen(128)  # from now on a browser opening the printed URL waits for uvicorn rather than being refused
    except OSError as err:
        sock.close()
        raise GptkitError(
            f"cannot listen on {host}:{port}: {err.strerror or err}; is another server on it? Stop it "
            "or pick another --port"
        ) from None
    return sock


def serve_watch(run_dir: Path, sock: socket.socket, allowed_hosts: tuple[str, ...] | None) -> None:
    """Serve run_dir's page on the bound socket until interrupted."""
    app = create_watch_app(run_dir, allowed_hosts)
    # Warnings only: the page asks every second, and a log line per ask would bury everything else.
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, limit_concurrency=64)
    uvicorn.Server(config).run(sockets=[sock])
