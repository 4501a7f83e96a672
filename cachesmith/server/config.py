"""The HTTP front's own settings (the engine's live in `ServiceConfig`)."""
from __future__ import annotations

from dataclasses import dataclass

from cachesmith.errors import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None  # when set, every route but /health needs "Authorization: Bearer <key>"
    max_body_bytes: int = 4 << 20
    drain_timeout_s: float = 60.0  # on shutdown: time to serve what is queued
    log_level: str = "info"
    # refuse a completion body's unknown top-level fields (default: accept, log and name them in the
    # x-cachesmith-ignored-fields header, as vLLM accepts them)
    is_strict: bool = False
    # open connections (and requests in progress) before uvicorn itself answers 503; None: room for
    # the queue, the batch being prefilled, every decoding stream and CONNECTION_MARGIN more
    max_connections: int | None = None
    # (key, tenant) pairs (`tenancy.read_api_keys`): each key names its tenant ("": the one unnamed)
    api_keys: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in 0..65535 (0: any free port)")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes={self.max_body_bytes} must be at least 1024")
        if self.drain_timeout_s <= 0:
            raise ConfigError(f"drain_timeout_s={self.drain_timeout_s} must be positive")
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError(f"max_connections={self.max_connections} must be >= 1")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key is empty; leave it unset to serve without one")
        for key, tenant in self.api_keys:
            if not key.strip() or key != key.strip():
                raise ConfigError(f"api_keys: tenant {tenant!r} has an empty key or one with spaces around it")

    @property
    def keys(self) -> tuple[tuple[str, str], ...]:
        """Every accepted (key, tenant): `api_keys`, and `api_key` as the unnamed tenant's."""
        return self.api_keys + (((self.api_key, ""),) if self.api_key is not None else ())
