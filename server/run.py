"""Run the app under uvicorn with a graceful drain: `run_server(settings) -> exit status`."""

from __future__ import annotations

import asyncio
import logging
import sys
from types import FrameType

import uvicorn

from server.backend import BackendFactory
from server.settings import Settings


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains first: /health answers 503 at once,
    new requests are still served for `drain_grace` seconds (the time a router polling /health
    needs to stop sending any), then admission stops (503), running requests finish (bounded by
    drain_timeout), and uvicorn exits normally (status 0). A second signal exits at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)  # second signal: uvicorn's own (force) exit
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        from server.app import drain

        app = self.config.app
        settings = app.state.settings  # type: ignore[attr-defined]
        app.state.leaving = True  # type: ignore[attr-defined]
        log = logging.getLogger("cellserve.server")
        if settings.drain_grace > 0:
            log.info("/health is 503; serving new requests for %.1f s more", settings.drain_grace)
            await asyncio.sleep(settings.drain_grace)
        log.info("draining before exit")
        await drain(app)  # type: ignore[arg-type]
        self.should_exit = True
        from sse_starlette.sse import AppStatus

        AppStatus.should_exit = True


def run_server(settings: Settings, backend_factory: BackendFactory | None = None) -> int:
    """Serve until SIGTERM/SIGINT (drained) or a model that fails to load (exit status 1)."""
    from server.app import create_app

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings, backend_factory)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=int(settings.drain_timeout) + 10,
    )
    server = DrainingServer(config)

    def stop_on_load_error(exc: BaseException) -> None:  # runs on the server's event loop
        server.should_exit = True

    app.state.on_load_error = stop_on_load_error
    print(f"cellserve: loading the model; will listen on {settings.url}", flush=True)
    server.run()
    if app.state.load_error:
        print(f"cellserve serve: cannot serve the model: {app.state.load_error}", file=sys.stderr)
        return 1
    return 0
