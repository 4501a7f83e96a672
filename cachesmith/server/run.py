"""Running the app with uvicorn: in the foreground (`cachesmith serve`: SIGINT/SIGTERM stop taking
connections, let in-flight requests finish, then drain the queue), or on a background thread
(`BackgroundServer`, for tests and the load benchmark; port 0 picks a free port). Past
`max_connections` open connections uvicorn answers 503 itself, before the app sees the request.
"""
from __future__ import annotations

import threading
import time

import uvicorn

from cachesmith.server.app import create_app
from cachesmith.server.config import ServerConfig
from cachesmith.server.service import Service


# connections beyond the queue, the batch and the decoding streams: health checks, metrics scrapes,
# chunk calls, idle keep-alive connections of client pools
CONNECTION_MARGIN = 32


def max_connections(service: Service, config: ServerConfig) -> int:
    """The configured limit, else room for every request the service may hold at once (queued or
    being admitted, in the batch being prefilled, decoding) and `CONNECTION_MARGIN` more."""
    if config.max_connections is not None:
        return config.max_connections
    return (service.config.max_queue + service.engine.config.scheduler.max_batch_size + service.loop.max_decoding
            + CONNECTION_MARGIN)


def _uvicorn_config(service: Service, config: ServerConfig) -> uvicorn.Config:
    return uvicorn.Config(create_app(service, config), host=config.host, port=config.port,
                          log_level=config.log_level, timeout_graceful_shutdown=config.drain_timeout_s,
                          access_log=config.log_level == "debug", lifespan="on",
                          limit_concurrency=max_connections(service, config))


def run_server(service: Service, config: ServerConfig) -> None:
    uvicorn.Server(_uvicorn_config(service, config)).run()


class BackgroundServer:
    """`with BackgroundServer(service, config) as srv: httpx.get(srv.url + "/health")`."""

    def __init__(self, service: Service, config: ServerConfig | None = None) -> None:
        config = config or ServerConfig(port=0, log_level="warning")
        self.service = service
        self.server = uvicorn.Server(_uvicorn_config(service, config))
        self._thread = threading.Thread(target=self.server.run, name="cachesmith-http", daemon=True)
        self.host = config.host

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
