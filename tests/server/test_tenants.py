"""Tenants that cannot see each other: a second tenant can neither list, read, delete, use nor
detect a first tenant's stored entries; a `cache_salt` splits further; shared chunks are shared on
purpose only; store caps refuse with a 429 before anything is written."""
from __future__ import annotations

import httpx
import pytest

from cachesmith.errors import ConfigError
from cachesmith.kvstore.keys import chunk_key, dtype_name
from cachesmith.model.config import ModelConfig, load_hf_config
from cachesmith.server import ServerConfig
from cachesmith.server.specs import ChunkInUse
from cachesmith.server.tenancy import Caller, StoreQuotaExceeded, parse_api_keys
from tests.server.conftest import make_service
from tests.server.test_app import body, error_of

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

KEYS = (("key-acme", "acme"), ("key-globex", "globex"))
TEXT = "a stored passage about rivers glaciers and lanterns in the harbor"
OTHER_ID = "0" * 64  # an id nobody stored


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def tenants_server(server_for, **overrides):
    return server_for(ServerConfig(port=0, log_level="warning", api_keys=KEYS), **overrides)


def upload(c: httpx.Client, key: str, *texts: str, **extra) -> list[dict]:
    r = c.post("/v1/chunks", json={"documents": list(texts), **extra}, headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()["data"]


def listed(c: httpx.Client, key: str, **params) -> list[str]:
    r = c.get("/v1/chunks", params=params, headers=auth(key))
    assert r.status_code == 200, r.text
    return [d["id"] for d in r.json()["data"]]


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_second_tenant_cannot_list_read_delete_or_use_the_firsts_chunk(server_for):
    srv = tenants_server(server_for)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        [mine] = upload(c, "key-acme", TEXT)
        assert mine["is_new"] and listed(c, "key-acme") == [mine["id"]]
        assert listed(c, "key-globex") == []
        for method in ("GET", "DELETE"):  # the same answer as for an id nobody stored
            theirs = c.request(method, f"/v1/chunks/{mine['id']}", headers=auth("key-globex"))
            nobodys = c.request(method, f"/v1/chunks/{OTHER_ID}", headers=auth("key-globex"))
            assert theirs.status_code == nobodys.status_code == 404
            assert error_of(theirs)["message"].replace(mine["id"], "X") == \
                error_of(nobodys)["message"].replace(OTHER_ID, "X")
        used = c.post("/v1/completions", json=body(documents=[{"id": mine["id"]}]), headers=auth("key-globex"))
        assert used.status_code == 404 and error_of(used)["code"] == "not_found"
        assert c.get(f"/v1/chunks/{mine['id']}", headers=auth("key-acme")).json()["text"].strip() == TEXT


def test_equal_text_from_two_tenants_is_two_entries_and_tells_nothing(server_for):
    srv = tenants_server(server_for)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        first_acme = cached(c.post("/v1/completions", json=body(), headers=auth("key-acme")))
        again_acme = cached(c.post("/v1/completions", json=body(), headers=auth("key-acme")))
        first_globex = cached(c.post("/v1/completions", json=body(), headers=auth("key-globex")))
        assert again_acme > first_acme  # the store serves a tenant's own text back
        assert first_globex == first_acme  # but not another tenant's: nothing cached for globex
        [a], [b] = upload(c, "key-acme", TEXT), upload(c, "key-globex", TEXT)
        assert a["is_new"] and b["is_new"] and a["id"] != b["id"]
        assert set(listed(c, "key-acme")).isdisjoint(listed(c, "key-globex"))


def test_a_chunk_in_use_is_in_use_only_for_its_own_tenant(tiny_chat_dir):
    service = make_service(tiny_chat_dir)
    try:
        acme, globex = Caller("acme"), Caller("globex")
        [record] = service.add_chunks([TEXT], caller=acme)
        service.chunks.pin([record.chunk_id], [])  # an in-flight request of acme reads it
        assert service.delete_chunk(record.chunk_id, globex) is False  # not a 409: globex learns nothing
        with pytest.raises(ChunkInUse):
            service.delete_chunk(record.chunk_id, acme)
    finally:
        service.close(10)


def test_a_cache_salt_splits_a_tenants_entries(server_for):
    srv = tenants_server(server_for)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        [plain], [salted] = upload(c, "key-acme", TEXT), upload(c, "key-acme", TEXT, cache_salt="s1")
        assert salted["is_new"] and salted["id"] != plain["id"]
        assert listed(c, "key-acme") == [plain["id"]]
        assert listed(c, "key-acme", cache_salt="s1") == [salted["id"]]
        assert c.get(f"/v1/chunks/{salted['id']}", headers=auth("key-acme")).status_code == 404
        r = c.post("/v1/completions", json=body(documents=[{"id": salted["id"]}], cache_salt="s1"),
                   headers=auth("key-acme"))
        assert r.status_code == 200, r.text


def test_shared_chunks_are_shared_on_purpose_and_conversations_stay_private(server_for):
    srv = tenants_server(server_for, is_chunk_shared=True)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        [a] = upload(c, "key-acme", TEXT)
        [b] = upload(c, "key-globex", TEXT)
        assert a["id"] == b["id"] and a["is_new"] and not b["is_new"] and b["shared"]
        chat = {"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "system", "content": "acme's private instructions"}, {"role": "user", "content": "hi"}]}
        assert c.post("/v1/chat/completions", json=chat, headers=auth("key-acme")).status_code == 200
        assert listed(c, "key-globex") == [a["id"]]  # the shared chunk, not acme's prompt prefix
        assert len(listed(c, "key-acme")) > 1
        r = c.delete(f"/v1/chunks/{a['id']}", headers=auth("key-globex"))
        assert r.status_code == 403 and error_of(r)["code"] == "chunk_shared"


def test_without_named_tenants_keys_are_as_before(server_for):
    srv = server_for(ServerConfig(port=0, log_level="warning", api_key="only"))
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        [record] = upload(c, "only", TEXT)
    pipeline = srv.server.config.app.state.service.pipeline
    model, ids = pipeline.model, pipeline.tokenizer.chunk_ids(TEXT)
    assert record["id"] == chunk_key(model.fingerprint, dtype_name(model.dtype), ids)  # precomputed stores serve


def test_a_request_past_the_store_token_cap_is_refused_before_storing(server_for):
    srv = server_for(max_store_tokens_per_request=8)
    store = srv.server.config.app.state.service.store
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for path, payload in (("/v1/chunks", {"documents": [TEXT]}), ("/v1/completions", body(documents=[TEXT]))):
            r = c.post(path, json=payload)
            err = error_of(r)
            assert r.status_code == 429 and err["code"] == "store_quota_exceeded", r.text
            assert "--max-store-tokens-per-request" in err["message"] and err["param"] == "documents"
            assert store.keys() == []  # nothing written, not even the prompt prefix
        assert c.post("/v1/chunks", json={"documents": ["two words"]}).status_code == 200


def test_a_tenant_past_its_byte_cap_gets_429_until_it_deletes(server_for, tiny_chat_dir):
    cfg = ModelConfig.from_hf(load_hf_config(tiny_chat_dir))
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 KV
    srv = tenants_server(server_for, tenant_max_bytes=per_token * 20)  # room for 20 tokens
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        [first] = upload(c, "key-acme", TEXT)
        assert 10 < first["num_tokens"] <= 20  # the next, longer one does not fit beside it
        r = c.post("/v1/chunks", json={"documents": [TEXT + " and more"]}, headers=auth("key-acme"))
        assert r.status_code == 429 and "--tenant-max-bytes" in error_of(r)["message"], r.text
        assert listed(c, "key-acme") == [first["id"]]  # the store as it was
        upload(c, "key-globex", TEXT + " and more")  # another tenant's quota is its own
        assert c.delete(f"/v1/chunks/{first['id']}", headers=auth("key-acme")).status_code == 200
        upload(c, "key-acme", TEXT + " and more")


@pytest.mark.parametrize("text, problem", [
    ("", "holds no key"),
    ("acme k1\nk2\n", "mixes bare keys"),
    ("acme k1\nglobex k1\n", "line 2: a key given twice"),
    ("acme k1 extra\n", "line 1: expected"),
    ("-bad k1\n", "line 1: tenant '-bad'"),
])
def test_a_bad_key_file_names_its_line(text, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_api_keys(text)


def test_a_key_file_names_tenants_and_keeps_bare_keys_as_one_tenant():
    assert parse_api_keys("# keys\nacme k1\n\nglobex k2  \nacme k3\n") == (
        ("k1", "acme"), ("k2", "globex"), ("k3", "acme"))
    assert parse_api_keys("k1\nk2\n") == (("k1", ""), ("k2", ""))  # rotation: two keys, one tenant


def test_bytes_of_an_entry_evicted_behind_the_servers_back_are_freed(tiny_chat_dir):
    cfg = ModelConfig.from_hf(load_hf_config(tiny_chat_dir))
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    service = make_service(tiny_chat_dir, tenant_max_bytes=per_token * 20)
    try:
        acme = Caller("acme")
        [first] = service.add_chunks([TEXT], caller=acme)
        assert service.chunks.usage.used(service.chunks.namespaces(acme).own) == first.num_tokens * per_token
        with pytest.raises(StoreQuotaExceeded):
            service.add_chunks([TEXT + " and more"], caller=acme)
        service.store.delete(first.chunk_id)  # a tier's quota evicted it, or another server deleted it
        [second] = service.add_chunks([TEXT + " and more"], caller=acme)
        assert second.is_new and [r.chunk_id for r in service.list_chunks(caller=acme)[0]] == [second.chunk_id]
    finally:
        service.close(10)


def test_an_upload_no_store_tier_can_take_is_a_503_not_a_crash(server_for, tmp_path):
    srv = server_for(tiers=("disk",), store_root=tmp_path)
    service = srv.server.config.app.state.service
    service.store.tiers[0].quota.max_bytes = 1024  # smaller than any entry
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for path, payload in (("/v1/chunks", {"documents": [TEXT]}), ("/v1/completions", body(documents=[TEXT]))):
            r = c.post(path, json=payload)
            assert r.status_code == 503 and error_of(r)["code"] == "store_unavailable", r.text
            assert "no store tier took its KV" in error_of(r)["message"]
        assert c.get("/health").status_code == 200
    assert service.queue_depth == 0 and not service.chunks._pins
