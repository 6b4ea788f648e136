"""`BootstrapEndpoint`: an engine's handshake endpoint, served over HTTP from a private event loop thread.

Imports aiohttp and `kvsvc.engine.bootstrap` (server, metadata route); for engine cores that are not asyncio
programs (`workers.executor`, the vLLM connector's scheduler side), whose blocking calls reach the loop thread
through `run_coroutine_threadsafe` with a timeout. Invariants: once bound, the URL (host
and port) stays the same across `serve` calls; `withdraw` stops handing out the old metadata before a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from aiohttp import web

import kvsvc.engine.netns
from kvsvc.core.messages import WorkerMetadata
from kvsvc.engine.bootstrap import METADATA_KEY, BootstrapServer, publish_metadata, serve_app
from kvsvc.service.service import new_event_loop

_START_TIMEOUT_S = 10.0


class BootstrapEndpoint:
    """The engine's handshake endpoint, served from a private event loop thread of the parent process."""

    def __init__(
        self,
        host: str,
        port: int,
        app: web.Application | None = None,
        *,
        netns: str | None = None,
        dp_rank: int = 0,
    ) -> None:
        """`netns`: a network namespace the loop thread joins before it binds (a test host); None stays here.
        `dp_rank`: the data-parallel rank whose engine this endpoint serves (`kvsvc.engine.bootstrap.QUERY_PATH`).

        Raises:
            NetnsError: `netns` cannot be joined. TimeoutError: the loop thread did not start.
        """
        self._host, self._port, self._dp_rank = host, port, dp_rank
        self._loop = new_event_loop()
        joined: list[BaseException | None] = []
        started = threading.Event()

        def run() -> None:
            try:
                if netns is not None:
                    kvsvc.engine.netns.join(netns)
                joined.append(None)
            except BaseException as exc:
                joined.append(exc)
                return
            finally:
                started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="bootstrap", daemon=True)
        self._thread.start()
        started.wait(_START_TIMEOUT_S)  # joining is one syscall: the bound only keeps the rule that every wait has one
        if not joined:
            raise TimeoutError(f"the endpoint thread did not start within {_START_TIMEOUT_S:g} s")
        if joined[0] is not None:
            self._loop.close()
            raise joined[0]
        self._server: BootstrapServer | None = None
        # `app` (e.g. the admin app, which carries the handshake route): bound once, metadata published in place.
        self._app = app
        self._runner: web.AppRunner | None = None
        self.url = ""

    def serve(self, metas: dict[tuple[int, int], WorkerMetadata], timeout_s: float) -> str:
        """Serve `metas` (replacing what was served); the URL stays the same once bound.

        Raises:
            OSError: the port cannot be bound. TimeoutError: the loop thread did not answer.
        """

        async def swap() -> str:
            if self._app is not None:
                publish_metadata(self._app, metas, self._dp_rank)
                if self._runner is None:
                    self._runner = await serve_app(self._app, self._host, self._port)
                    self._port = int(self._runner.addresses[0][1])
                return f"http://{self._host}:{self._port}"
            # A new server per publication: aiohttp apps must not change after they started.
            if self._server is not None:
                await self._server.close()
            self._server = BootstrapServer(metas, host=self._host, port=self._port, dp_rank=self._dp_rank)
            url = await self._server.start()
            self._port = int(url.rsplit(":", 1)[1])
            return url

        self.url = asyncio.run_coroutine_threadsafe(swap(), self._loop).result(timeout_s)
        return self.url

    def withdraw(self, timeout_s: float) -> None:
        """Stop serving (a restarting engine must not hand out its old incarnation)."""
        if self._app is not None:
            self._app[METADATA_KEY].clear()  # the handshake route answers 503 until the next `serve`
        if self._server is not None:
            server, self._server = self._server, None
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(server.close(), self._loop).result(timeout_s)

    def close(self, timeout_s: float) -> None:
        self.withdraw(timeout_s)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
