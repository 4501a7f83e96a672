"""`benchmarks/soak.py`'s parts that need no server: the fault schedule, the read-only store, the disk
samples, the request and integrity accounting, and the clients against a fake server (httpx's
MockTransport) that keeps tenants apart, or, leaky, does not."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import httpx
import pytest

from benchmarks.common.soak_faults import DiskSamples, ReadOnlyDisk, plan_faults, scan_store
from benchmarks.common.soak_report import Ack, Ledger, Record, bars, classify, is_5xx, percentile, \
    summarize_integrity, summarize_requests
from benchmarks.common.soak_traffic import Tenant, Traffic, build_tenants

KILLED = {"name": "server_killed", "start_s": 100.0, "end_s": 150.0}
REDIS = {"name": "redis_down", "start_s": 20.0, "end_s": 40.0}


# -- the schedule --------------------------------------------------------------------------------
def test_faults_fit_the_run_in_order_without_overlapping():
    plan = plan_faults(600, ("redis", "readonly", "kill"), redis_down_s=20, readonly_s=30, kill_hold_s=60, gap_s=10)
    assert [f.name for f in plan] == ["redis", "readonly", "kill"]
    assert plan[0].at_s >= 10
    for earlier, later in zip(plan, plan[1:]):
        assert later.at_s >= earlier.at_s + earlier.hold_s + 10
    assert plan[-1].at_s + plan[-1].hold_s <= 600 - 10
    assert plan_faults(60, ()) == []


def test_a_cluster_soak_kills_a_primary_in_place_of_the_redis_server():
    from benchmarks.soak import parse_args

    assert parse_args(["--redis-cluster"]).fault_names == ("primary", "readonly", "kill")
    assert parse_args([]).fault_names == ("redis", "readonly", "kill")
    for wrong in (["--faults", "primary"], ["--redis-cluster", "--faults", "redis,kill"]):
        with pytest.raises(SystemExit):
            parse_args(wrong)
    [primary] = plan_faults(60.0, ("primary",), redis_down_s=20.0)
    assert (primary.name, primary.hold_s) == ("primary", 20.0)


def test_a_schedule_that_does_not_fit_or_names_an_unknown_fault_is_refused():
    assert len(plan_faults(150, ("redis", "readonly", "kill"), 20, 30, 60, 10)) == 3  # exactly: no slack
    with pytest.raises(ValueError, match="need 150 s"):
        plan_faults(149, ("redis", "readonly", "kill"), 20, 30, 60, 10)  # 110 held + 4 gaps of 10
    with pytest.raises(ValueError, match="at most once"):
        plan_faults(600, ("kill", "kill"))
    with pytest.raises(ValueError, match="at most once"):
        plan_faults(600, ("reboot",))


# -- the store's folder --------------------------------------------------------------------------
def test_read_only_store_refuses_writes_and_is_restored(tmp_path):
    root = tmp_path / "kv"
    (root / "ab").mkdir(parents=True)
    ro = ReadOnlyDisk(root)
    assert ro.method is not None, ro.note  # root, whom chmod does not stop: chattr +i, which these machines carry
    ro.apply()
    try:
        with pytest.raises(OSError):
            (root / "ab" / "new.cskv").write_bytes(b"x")
        with pytest.raises(OSError):
            (root / "cd").mkdir()
    finally:
        ro.restore()
    (root / "ab" / "new.cskv").write_bytes(b"x")
    assert not ro.is_applied


def test_scan_and_samples_count_entries_temporary_files_and_evictions(tmp_path):
    key_a, key_b = "a" * 64, "b" * 64
    (tmp_path / "aa").mkdir()
    (tmp_path / "bb").mkdir()
    (tmp_path / "aa" / f"{key_a}.cskv").write_bytes(b"x" * 100)
    (tmp_path / "bb" / f"{key_b}.cskv").write_bytes(b"x" * 50)
    (tmp_path / "bb" / f".{key_b}.cskv.123.abcd.tmp").write_bytes(b"x" * 7)
    assert scan_store(tmp_path) == (150, 7, {key_a, key_b})
    samples = DiskSamples(quota=155)
    samples.add(*scan_store(tmp_path))
    (tmp_path / "aa" / f"{key_a}.cskv").unlink()
    samples.add(*scan_store(tmp_path))
    assert (samples.max_with_tmp_bytes, samples.max_entry_bytes, samples.num_over_quota) == (157, 150, 1)
    assert samples.evicted_seen == {key_a}
    assert scan_store(tmp_path / "missing") == (0, 0, set())


# -- request accounting --------------------------------------------------------------------------
def rec(status: str, start: float, end: float, kind: str = "chat", **kw) -> Record:
    return Record(kind, "alice", start, end, status, **kw)


def test_failures_inside_the_killed_window_are_expected_and_outside_it_counted():
    records = [rec("500", 120, 121), rec("conn_error", 90, 101),  # overlap the killed window
               rec("503", 30, 31), rec("stream_error", 60, 61, code="server_error"),  # a redis outage, steady
               rec("stream_error", 62, 63, code="invalid_request_error"), rec("timeout", 160, 170),
               rec("429", 10, 10.1, code="queue_full", has_retry_after=False),
               rec("429", 11, 11.1, code="queue_full", has_retry_after=True),
               rec("200", 1, 2, ttft_client_s=0.5, ttft_server_s=0.4), rec("200", 3, 4, ttft_client_s=2.0)]
    out = summarize_requests(records, [REDIS, KILLED])
    assert out["num_5xx_outside_killed_window"] == 2
    assert {e["phase"] for e in out["examples_5xx_outside_killed_window"]} == {"redis_down", "steady"}
    assert out["num_connection_failures_outside_killed_window"] == 1
    assert out["num_failures_in_killed_window"] == 2
    assert out["by_phase"]["server_killed"] == {"500": 1, "conn_error": 1}
    assert out["num_429_by_code"] == {"queue_full": 2}
    assert out["num_429_queue_full_without_retry_after"] == 1
    assert out["ttft"]["num_admitted"] == 2 and out["ttft"]["client_p99_s"] == 2.0
    assert out["ttft"]["server_p50_s"] == 0.4


def test_a_store_refusal_is_expected_only_inside_a_store_fault_and_its_back_off():
    refused = dict(code="store_unavailable", kind="delete_own")
    records = [rec("503", 30, 31, **refused),  # redis down: the delete it cannot carry there, refused
               rec("503", 41, 41.1, **refused),  # redis back, the tier still backing off (5 s)
               rec("503", 1, 2, **refused),  # steady: a store tier refusing for no injected reason
               rec("503", 50, 51, **refused),  # steady, past the back-off
               rec("503", 32, 33, kind="delete_own", code="shutting_down")]  # in the fault, another cause
    out = summarize_requests(records, [REDIS, KILLED])
    assert out["num_503_store_unavailable_in_store_faults"] == 2
    assert out["num_5xx_outside_killed_window"] == 3
    assert {(e["phase"], e["code"]) for e in out["examples_5xx_outside_killed_window"]} == {
        ("steady", "store_unavailable"), ("redis_down", "shutting_down")}


def test_percentile_is_nearest_rank_and_5xx_includes_server_errors_in_streams():
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([3.0], 50) == 3.0 and percentile([], 99) is None
    assert is_5xx(rec("502", 0, 1)) and is_5xx(rec("stream_error", 0, 1, code="server_error"))
    assert not is_5xx(rec("429", 0, 1)) and not is_5xx(rec("stream_error", 0, 1, code="invalid_request_error"))


# -- integrity -----------------------------------------------------------------------------------
def ack(tiers, chunk_id="c" * 64) -> Ack:
    return Ack(chunk_id, "bob", 5.0, tuple(tiers), False)


def test_a_missing_chunk_is_evicted_only_when_disk_was_its_only_durable_tier():
    assert classify(ack(["memory", "disk", "redis"]), "200", set()) == "ok"
    assert classify(ack(["memory", "disk"]), "404", set()) == "evicted_disk_quota"
    assert classify(ack(["memory", "disk", "redis"]), "404", set()) == "lost"  # redis persists every write
    assert classify(ack(["memory"]), "404", set()) == "lost"  # acknowledged, nothing durable held it
    assert classify(ack(["memory", "disk"], "d" * 64), "404", {"d" * 12}) == "corrupt"
    assert classify(ack(["memory", "disk"]), "conn_error", set()) == "unchecked"


def test_integrity_summary_counts_and_explains_what_is_not_ok():
    lost, evicted = ack(["memory", "redis"], "1" * 64), ack(["memory", "disk"], "2" * 64)
    out = summarize_integrity([(ack(["disk", "redis"], "0" * 64), "200"), (lost, "404"), (evicted, "404")],
                              set(), {lost.chunk_id: False, evicted.chunk_id: False}, {evicted.chunk_id})
    assert (out["num_checked"], out["ok"], out["lost"], out["evicted_disk_quota"]) == (3, 1, 1, 1)
    by_id = {d["id"]: d for d in out["not_ok"]}
    assert by_id[lost.chunk_id]["verdict"] == "lost" and not by_id[lost.chunk_id]["eviction_seen_on_disk"]
    assert by_id[evicted.chunk_id]["eviction_seen_on_disk"]


def test_ledger_keeps_deletes_reacks_and_foreign_ids_apart():
    led = Ledger()
    led.ack("alice", "a1", ["disk"], 1.0, None)
    led.ack("bob", "b1", ["disk"], 1.0, "shared text")
    led.ack("alice", "a2", ["disk"], 1.0, "shared text")
    assert [a.chunk_id for a in led.foreign("alice")] == ["b1"]
    assert led.id_collisions() == 0
    led.ack("carol", "b1", ["disk"], 2.0, "shared text")  # the same id for another tenant's identical text
    assert led.id_collisions() == 1
    assert led.foreign("carol") == [led.acks[("alice", "a1")], led.acks[("alice", "a2")]]
    led.acks[("alice", "a1")].state = "deleting"
    led.ack("alice", "a1", ["disk"], 3.0, None)  # stored again while its delete is in flight
    assert led.acks[("alice", "a1")].reacked
    assert not led.note_cross("get", "alice", "bob", "b1", "404")
    assert led.note_cross("get", "alice", "bob", "b1", "200")
    assert led.cross["get:attempts"] == 2 and led.cross["get:successes"] == 1
    assert led.cross["get:status:404"] == 1


def test_bars_fail_past_their_targets():
    payload = {"requests": summarize_requests([rec("500", 1, 2)], []), "integrity": {"num_corrupt_evictions_logged": 0},
               "cross_tenant": {"measured": True, "num_successes": 0, "identical_text_id_collisions": 0},
               "store": {"disk_quota_bytes": 100, "max_with_tmp_bytes": 101}}
    by_name = {b["bar"]: b for b in bars(payload)}
    assert by_name["5xx outside the killed window (but store_unavailable in a store fault)"]["passed"] is False
    assert by_name["cross-tenant reads"]["passed"] is True
    assert by_name["max disk tier bytes (entries + temporary files)"]["passed"] is False
    assert by_name["acknowledged chunks lost (after restart)"]["passed"] is None  # not checked: no restart


# -- the clients against a fake server -----------------------------------------------------------
class FakeServer:
    """Chunks keyed by (tenant, text) unless `leaky`, when every tenant sees and reaches every chunk."""

    def __init__(self, keys: dict[str, str], leaky: bool = False) -> None:
        self.tenant_of, self.leaky = keys, leaky
        self.chunks: dict[str, str] = {}  # id -> tenant

    def visible(self, tenant: str, chunk_id: str) -> bool:
        return chunk_id in self.chunks and (self.leaky or self.chunks[chunk_id] == tenant)

    def handle(self, request: httpx.Request) -> httpx.Response:
        tenant = self.tenant_of.get(request.headers.get("authorization", "").removeprefix("Bearer "))
        if tenant is None:
            return httpx.Response(401, json={"error": {"code": "invalid_api_key"}})
        path, body = request.url.path, json.loads(request.content or b"{}")
        if path == "/v1/chunks" and request.method == "POST":
            ids = [hashlib.sha256(((tenant if not self.leaky else "") + t).encode()).hexdigest() for t in body["documents"]]
            self.chunks.update({i: tenant for i in ids})
            return httpx.Response(200, json={"data": [{"id": i, "tiers": ["memory", "disk", "redis"]} for i in ids]})
        if path == "/v1/chunks":
            return httpx.Response(200, json={"data": [{"id": i} for i in self.chunks if self.visible(tenant, i)],
                                             "has_more": False})
        if path.startswith("/v1/chunks/"):
            chunk_id = path.rsplit("/", 1)[1]
            if not self.visible(tenant, chunk_id):
                return httpx.Response(404, json={"error": {"code": "not_found"}})
            if request.method == "DELETE":
                del self.chunks[chunk_id]
            return httpx.Response(200, json={"id": chunk_id})
        refs = [d["id"] for d in body.get("documents", []) if isinstance(d, dict)]
        if any(not self.visible(tenant, i) for i in refs):
            return httpx.Response(404, json={"error": {"code": "not_found"}})
        return httpx.Response(200, json={"choices": []})


def traffic_for(server: FakeServer, keys: dict[str, str]) -> Traffic:
    passages = [f"passage {i} " + "word " * 40 for i in range(200)]
    tenants, shared = build_tenants(passages, list(keys.values()), list(keys), 5, 3, 20)
    return Traffic("http://fake", tenants, shared, lambda: 0.0, "m", transport=httpx.MockTransport(server.handle))


async def uploads_then_probes(traffic: Traffic) -> None:
    for _ in range(10):
        for tenant in traffic.tenants:
            await traffic.op("upload", tenant)
    for _ in range(30):
        for tenant in traffic.tenants:
            await traffic.op("cross", tenant)
    for tenant in traffic.tenants:
        await traffic.op("list_own", tenant)
    await traffic.aclose()


@pytest.mark.parametrize("leaky", [False, True])
def test_cross_tenant_reads_are_counted_only_where_the_server_leaks(leaky):
    keys = {"k-alice": "alice", "k-bob": "bob", "k-carol": "carol"}
    traffic = traffic_for(FakeServer(keys, leaky), keys)
    asyncio.run(uploads_then_probes(traffic))
    led = traffic.ledger
    assert led.cross["list:attempts"] == 3
    assert sum(led.cross[f"{k}:attempts"] for k in ("get", "delete", "ref")) == 90
    successes = sum(led.cross[f"{k}:successes"] for k in ("get", "delete", "ref", "list"))
    assert (successes > 0) == leaky
    assert (led.id_collisions() > 0) == (leaky and bool(led.shared_ids))
    assert all(r.status in ("200", "404") for r in traffic.records)


def sse(*events: str) -> httpx.MockTransport:
    text = "".join(f"data: {e}\n\n" for e in events)
    return httpx.MockTransport(lambda request: httpx.Response(200, text=text,
                                                              headers={"content-type": "text/event-stream"}))


@pytest.mark.parametrize("events, status, code", [
    (['{"choices": []}', '{"choices": [], "cachesmith": {"ttft_ms": 250.0}}', "[DONE]"], "200", None),
    (['{"choices": []}'], "stream_cut", None),
    (['{"choices": []}', '{"error": {"type": "server_error", "message": "boom"}}', "[DONE]"], "stream_error",
     "server_error")])
def test_a_stream_is_read_to_its_end_and_what_went_wrong_inside_it_is_kept(events, status, code):
    tenant = Tenant("alice", "k", ["doc"], ["up"])
    traffic = Traffic("http://fake", [tenant], ["shared"], lambda: 0.0, "m", transport=sse(*events))
    record = Record("chat", "alice", 0.0)

    async def go():
        await traffic.stream(record, "/v1/chat/completions", tenant, traffic.body(tenant, "chat"))
        await traffic.aclose()

    asyncio.run(go())
    assert (record.status, record.code) == (status, code)
    assert record.ttft_client_s is not None
    assert record.ttft_server_s == (0.25 if status == "200" else None)
    assert traffic.records == [record]


def test_an_own_chunk_answered_404_counts_as_lost_only_outside_fault_windows_and_unless_evicted():
    records = [rec("404", 1, 2, kind="get_own", detail="own_lost c (tiers memory+disk+redis)"),
               rec("404", 25, 26, kind="get_own", detail="own_lost d (tiers memory+redis)"),  # redis was down
               rec("404", 3, 4, kind="by_id", detail="own_evicted_disk_quota e (tiers memory+disk)"),
               rec("404", 5, 6, kind="cross_get")]  # another tenant's: not an own chunk
    out = summarize_requests(records, [REDIS])
    assert out["num_own_lost_steady"] == 1
    assert out["own_missing_by_phase"] == {"steady:own_lost": 1, "redis_down:own_lost": 1,
                                           "steady:own_evicted_disk_quota": 1}


def test_a_scan_never_counts_an_evicted_entry_beside_the_write_that_evicted_it(tmp_path, monkeypatch):
    """The server evicts an entry in a folder already listed, then writes one in a folder listed
    later, during one scan: the two never lay on disk together, and the scan counts only the new."""
    old, new = "a" * 64, "b" * 64
    for sub in ("aa", "bb"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / f"{old}.cskv").write_bytes(b"x" * 100)  # the first folder listed keeps it
    real, listed = os.scandir, []

    def scandir(path):
        if Path(path) != tmp_path:
            listed.append(Path(path))
            if len(listed) == 1:
                (listed[0].parent / ("bb" if listed[0].name == "aa" else "aa") / f"{old}.cskv").unlink()
            else:  # between the two folders' listings: evict from the first, then write in the second
                (listed[0] / f"{old}.cskv").unlink()
                (listed[1] / f"{new}.cskv").write_bytes(b"x" * 100)
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert scan_store(tmp_path) == (100, 0, {new})
