"""A redis server's byte bound: read it, warn when there is none, or set it when asked.

In: a redis client and, optionally, the bytes the operator wants redis to hold at most. Out: the
server's `maxmemory*` settings as text ({} when CONFIG is refused, as managed services do, or the
server is unreachable). A tier cannot bound the bytes of a redis that other servers write to, so
the server's own `maxmemory` with `allkeys-lru` is the bound: set here at start when
`redis_max_bytes` is given, for a redis the store may configure.
"""
from __future__ import annotations

import logging

from cachesmith.errors import ConfigError

log = logging.getLogger(__name__)
POLICY = "allkeys-lru"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def memory_config(client, url: str, ttl_s: int | None, refused: tuple[type[BaseException], ...],
                  max_bytes: int | None = None) -> dict[str, str]:
    """The server's maxmemory settings after setting them to `max_bytes` (None: left as they are,
    warned about when unbounded). Raises `ConfigError` when `max_bytes` cannot be set."""
    if max_bytes is not None:
        try:
            client.config_set("maxmemory", max_bytes)
            client.config_set("maxmemory-policy", POLICY)
        except refused as exc:
            raise ConfigError(f"redis_max_bytes={max_bytes}: the redis server at {url} refused CONFIG SET ({exc}); "
                              f"set maxmemory and maxmemory-policy {POLICY} on the server itself") from exc
    try:
        config = {_text(k): _text(v) for k, v in client.config_get("maxmemory*").items()}
    except refused:
        return {}
    if config.get("maxmemory") == "0":
        log.warning("redis tier %s: the server has maxmemory 0, so only the TTL (ttl_s=%s) bounds the "
                    "entries' bytes; set maxmemory and maxmemory-policy %s on it (or --redis-max-bytes)",
                    url, ttl_s, POLICY)
    return config
