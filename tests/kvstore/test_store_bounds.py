"""Bounds outside the disk quota itself: redis TTLs and the maxmemory warning, StoreConfig's fields,
`serve`'s flags, and `cachesmith store stats|prune`."""
from __future__ import annotations

import argparse
import os
import re
import time

import pytest
import redis

from cachesmith import cli, cli_store
from cachesmith.errors import ConfigError
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.kvstore.disk_tier import DiskTier
from cachesmith.kvstore.redis_tier import DEFAULT_REDIS_TTL_S, RedisTier


def _key(i: int) -> str:
    return f"{i:064x}"


def test_redis_entries_expire_and_a_read_restarts_the_ttl(redis_url):
    tier = RedisTier(redis_url, ttl_s=100)
    client = redis.Redis.from_url(redis_url)
    assert tier.put(_key(1), b"x" * 10)
    assert 90 < client.ttl(tier.PREFIX + _key(1)) <= 100
    client.expire(tier.PREFIX + _key(1), 5)
    assert tier.source(_key(1)).size == 10
    assert client.ttl(tier.PREFIX + _key(1)) > 90  # refreshed by the read
    forever = RedisTier(redis_url, ttl_s=None)
    forever.put(_key(2), b"y")
    assert client.ttl(forever.PREFIX + _key(2)) == -1 and forever.source(_key(2)).size == 1


def test_the_store_sets_the_default_ttl(redis_url):
    store = ChunkStore(StoreConfig(tiers=("redis",), redis_url=redis_url))
    store.tiers[0].put(_key(3), b"z")
    assert store.tiers[0].ttl_s == DEFAULT_REDIS_TTL_S == 7 * 24 * 3600
    assert DEFAULT_REDIS_TTL_S - 10 < redis.Redis.from_url(redis_url).ttl(RedisTier.PREFIX + _key(3))
    store.close()


def test_an_unbounded_redis_is_warned_about_unless_config_is_refused(redis_server, caplog, monkeypatch):
    RedisTier(redis_server.url)
    assert "maxmemory 0" in caplog.text and "allkeys-lru" in caplog.text
    caplog.clear()
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory", 10 << 20)
    client.config_set("maxmemory-policy", "allkeys-lru")
    tier = RedisTier(redis_server.url)
    assert "maxmemory" not in caplog.text
    assert tier.usage().max_bytes == 10 << 20 and "allkeys-lru" in tier.usage().note
    client.config_set("maxmemory", 0)

    def refused(*args, **kwargs):
        raise redis.exceptions.ResponseError("unknown command 'CONFIG'")  # managed redis services

    monkeypatch.setattr(redis.Redis, "config_get", refused)
    tier = RedisTier(redis_server.url)
    assert "maxmemory" not in caplog.text and tier.memory_config == {}
    assert tier.put(_key(4), b"w") and tier.usage().note.startswith("maxmemory unknown")


def test_redis_max_bytes_sets_the_servers_bound_or_says_why_not(redis_server, caplog, monkeypatch):
    client = redis.Redis.from_url(redis_server.url)
    try:
        tier = RedisTier(redis_server.url, max_bytes=32 << 20)
        assert client.config_get("maxmemory")["maxmemory"] == str(32 << 20)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        assert tier.usage().max_bytes == 32 << 20 and "maxmemory 0" not in caplog.text

        def refused(*args, **kwargs):
            raise redis.exceptions.ResponseError("unknown command 'CONFIG'")

        monkeypatch.setattr(redis.Redis, "config_set", refused)
        with pytest.raises(ConfigError, match=r"redis_max_bytes=1024: the redis server .* refused CONFIG SET"):
            RedisTier(redis_server.url, max_bytes=1024)
    finally:
        monkeypatch.undo()
        client.config_set("maxmemory", 0)


def test_store_config_names_the_field_and_limit(tmp_path):
    with pytest.raises(ConfigError, match=r"disk_max_bytes=-1 must be positive, or 0/None for the default \(50%"):
        StoreConfig(disk_max_bytes=-1)
    with pytest.raises(ConfigError, match="redis_max_bytes=0 must be positive"):
        StoreConfig(redis_max_bytes=0)
    with pytest.raises(ConfigError, match="redis_ttl_s=0 must be a positive number of seconds"):
        StoreConfig(tiers=("redis",), redis_url="redis://127.0.0.1:1/0", redis_ttl_s=0)
    store = ChunkStore(StoreConfig(tiers=("memory", "disk"), root=tmp_path, disk_max_bytes=12345))
    assert store.tiers[1].quota.max_bytes == 12345 and not store.tiers[1].is_default_quota


@pytest.mark.parametrize("text, want", [("20G", 20 << 30), ("500M", 500 << 20), ("1048576", 1 << 20),
                                        ("1.5K", 1536), ("64KiB", 64 << 10), ("2t", 2 << 40), ("10b", 10)])
def test_byte_sizes_parse_with_binary_suffixes(text, want):
    assert cli_store.parse_bytes(text) == want


def test_bad_byte_sizes_are_refused():
    for bad in ("20X", "-1", "G", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected bytes"):
            cli_store.parse_bytes(bad)


def test_serve_passes_the_bounds_into_store_config():
    args = cli.build_parser().parse_args(["serve", "--disk-max-bytes", "20G", "--redis-ttl-s", "3600",
                                          "--redis-max-bytes", "8G"])
    assert cli_store.store_bounds(args) == {"disk_max_bytes": 20 << 30, "redis_ttl_s": 3600,
                                            "redis_max_bytes": 8 << 30, "codec": "none"}
    never = cli.build_parser().parse_args(["serve", "--redis-ttl-s", "0"])
    assert StoreConfig(**cli_store.store_bounds(never)).redis_ttl_s is None  # 0: no expiry
    default = cli.build_parser().parse_args(["serve"])
    config = StoreConfig(**cli_store.store_bounds(default))
    assert config.disk_max_bytes is None and config.redis_ttl_s == DEFAULT_REDIS_TTL_S
    assert config.redis_max_bytes is None


def _fill(root, sizes, hours_ago=None) -> DiskTier:
    tier = DiskTier(root, max_bytes=1 << 20)
    now = time.time()
    for i, size in enumerate(sizes):
        tier.put(_key(i), bytes(size))
        if hours_ago is not None:
            os.utime(tier.path(_key(i)), (now - 3600 * hours_ago[i],) * 2)
    return tier


def test_store_stats_prints_entries_bytes_quota_and_oldest_access(tmp_path, capsys):
    _fill(tmp_path, [100, 200, 300], hours_ago=[72, 48, 1])
    assert cli.main(["store", "stats", "--store-root", str(tmp_path), "--disk-max-bytes", "1K"]) == 0
    line, codecs = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("disk   entries 3  bytes 600 (600 B)  quota 1024 (1.0 KiB)")
    assert codecs == "codecs no entries"  # three unreadable files: no header names a codec
    assert re.search(r"oldest access \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(3\.0 days ago\)", line)
    assert cli.main(["store", "stats", "--store-root", str(tmp_path / "typo")]) == 2
    assert "no store there" in capsys.readouterr().err and not (tmp_path / "typo").exists()


def test_store_stats_of_redis(redis_server, tmp_path, capsys):
    tier = RedisTier(redis_server.url)
    tier.put(_key(1), bytes(10))
    tier.put(_key(2), bytes(20))
    assert cli.main(["store", "stats", "--store-root", str(tmp_path), "--redis-url", redis_server.url]) == 0
    disk, shared, _ = capsys.readouterr().out.strip().splitlines()
    assert disk.startswith("disk   entries 0  bytes 0")
    assert shared.startswith("redis  entries 2  bytes 30 (30 B)  quota none")
    assert "maxmemory 0: unbounded; ttl_s=604800" in shared


def test_store_prune_down_to_max_bytes_goes_least_recently_used_first(tmp_path, capsys, monkeypatch):
    _fill(tmp_path, [100, 200, 300, 400], hours_ago=[1, 4, 3, 2])  # access order: 1, 2, 3, 0
    monkeypatch.setattr(cli_store, "PROGRESS_EVERY_S", 0.0)  # a progress line per entry
    assert cli.main(["store", "prune", "--store-root", str(tmp_path), "--max-bytes", "600"]) == 0
    out, err = capsys.readouterr()
    assert "pruned entries 2  bytes 500 (500 B); left entries 2  bytes 500" in out
    assert err.splitlines() == ["pruning: entries 1  bytes 200 (200 B) so far",
                                "pruning: entries 2  bytes 500 (500 B) so far"]
    assert sorted(p.stem for p in tmp_path.glob("*/*.cskv")) == [_key(0), _key(3)]
    assert cli.main(["store", "prune", "--store-root", str(tmp_path), "--older-than", "0.06"]) == 0  # 1.44 h
    assert "pruned entries 1  bytes 400" in capsys.readouterr().out
    assert [p.stem for p in tmp_path.glob("*/*.cskv")] == [_key(0)]


def test_store_prune_needs_a_bound(tmp_path, capsys):
    assert cli.main(["store", "prune", "--store-root", str(tmp_path)]) == 2
    assert "--max-bytes N and/or --older-than DAYS" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["precompute", "corpus.jsonl"], ["bench"]])
def test_every_command_that_stores_takes_the_bounds(command, tmp_path):
    args = cli.build_parser().parse_args([*command, "--disk-max-bytes", "1G", "--redis-ttl-s", "60",
                                          "--store-root", str(tmp_path), "--kv-codec", "int4"])
    assert cli_store.store_bounds(args) == {"disk_max_bytes": 1 << 30, "redis_ttl_s": 60, "redis_max_bytes": None,
                                            "codec": "int4"}
    store = cli._store(args)
    assert store.tiers[1].quota.max_bytes == 1 << 30 and store.config.codec == "int4"  # bounded and coded as asked


def test_store_stats_names_each_codec_and_its_bytes_per_token(model, tmp_path, capsys):
    from cachesmith.kvstore import ChunkStore, StoreConfig
    from cachesmith.model import prefill_chunk

    chunk = prefill_chunk(model, list(range(3, 103)))
    for codec in ("none", "int8"):
        store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path, codec=codec))
        store.put(chunk)
        per_token = store.stats.bytes_per_token()
        assert list(per_token) == [codec] and per_token[codec] > 0
        store.close()
    assert cli.main(["store", "stats", "--store-root", str(tmp_path)]) == 0
    codecs = capsys.readouterr().out.strip().splitlines()[-1]
    found = dict(re.findall(r"(\w+) 1 entries, ([\d,]+) bytes/token", codecs))
    assert set(found) == {"none", "int8"}
    assert int(found["int8"].replace(",", "")) < 0.3 * int(found["none"].replace(",", ""))
