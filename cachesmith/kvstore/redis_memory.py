"""A redis server's byte bound: read it, warn when there is none, or set it when asked; on a cluster,
each node's.

In: a redis client (one server's, or a cluster's) and, optionally, the bytes the operator wants each
redis server to hold at most. Out: the `maxmemory*` settings as text ({} when CONFIG is refused, as
managed services do, or the server is unreachable), for a cluster one dict per node by its name. A tier cannot bound the bytes of a redis that other servers write to, so
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
                  max_bytes: int | None = None, is_cluster: bool = False) -> dict:
    """The server's maxmemory settings after setting them to `max_bytes` (None: left as they are,
    warned about when unbounded); on a cluster, every node's by name, replicas included (one may
    become a primary). Raises `ConfigError` when `max_bytes` cannot be set."""
    if not is_cluster:
        return _node_config(client, url, ttl_s, refused, max_bytes)
    import redis

    config = {}
    for name in node_roles(client):
        host, port = name.rsplit(":", 1)
        node = redis.Redis(host=host, port=int(port), **_timeouts(client))
        try:
            config[name] = _node_config(node, f"{url} node {name}", ttl_s, refused, max_bytes, is_warned=False)
        finally:
            node.close()
    unbounded = sorted(name for name, c in config.items() if c.get("maxmemory") == "0")
    if unbounded:
        log.warning("redis tier %s: %d of the cluster's %d nodes have maxmemory 0 (%s), so only the TTL (ttl_s=%s) "
                    "bounds their entries' bytes; set maxmemory and maxmemory-policy %s on every node (or "
                    "--redis-max-bytes)", url, len(unbounded), len(config), ", ".join(unbounded), ttl_s, POLICY)
    return config


def node_roles(client) -> dict[str, str]:
    """A cluster's nodes as the cluster tells them now (`CLUSTER NODES`): "host:port" -> "primary"
    (serving slots) or "replica"; a node marked failed is left out."""
    roles = {}
    for address, node in client.cluster_nodes().items():
        flags = node.get("flags", "")
        if "fail" in flags or "noaddr" in flags:
            continue
        roles[address.split("@")[0]] = "primary" if "master" in flags and node.get("slots") else "replica"
    return roles


def _timeouts(client) -> dict:
    kwargs = client.get_connection_kwargs() if hasattr(client, "get_connection_kwargs") else {}
    return {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kwargs}


def _node_config(client, url: str, ttl_s: int | None, refused: tuple[type[BaseException], ...],
                 max_bytes: int | None, is_warned: bool = True) -> dict[str, str]:
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
    if config.get("maxmemory") == "0" and is_warned:
        log.warning("redis tier %s: the server has maxmemory 0, so only the TTL (ttl_s=%s) bounds the "
                    "entries' bytes; set maxmemory and maxmemory-policy %s on it (or --redis-max-bytes)",
                    url, ttl_s, POLICY)
    return config
