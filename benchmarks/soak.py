"""A soak of `cachesmith serve` as an operator runs it: three tenants' mixed traffic past the server's
capacity for minutes, through a memory + disk + redis store with a small disk quota, while redis is
killed and restarted, the disk tier goes read-only for a while and the server itself is killed with
SIGKILL and restarted on the same store. Run at review, not in CI.

  python -m benchmarks.soak [--minutes 10 --load 1.5] [--out docs/bench/soak.json]
  python -m benchmarks.soak --minutes 2 --faults kill --capacity-s 10   (a short look)
  python -m benchmarks.soak --tenant-mode single ...   (a server whose --api-key-file takes one key)
  python -m benchmarks.soak --redis-cluster ...   (a local Redis Cluster; a primary SIGKILLed, not redis)

Steps: its own redis-server (append-only, fsync always) and `cachesmith serve` as children; the
server's capacity measured by a short closed loop of chats; then Poisson arrivals at --load x that
capacity (chats and completions with documents, slo_ms and 8-16 new tokens, streamed; chunk uploads,
reads, listings and deletes; completions on stored chunk ids; cross-tenant probes; requests without
the key) while the faults run on schedule. Every chunk a tenant was told is stored is checked by that
tenant after the restart and at the end; the disk folder's bytes are sampled every second against
the quota. Out: a table on stdout (requests by phase and status, fault windows, each bar against its
target) and, with --out, the JSON payload; the work folder (server and redis logs) is printed and kept.
Ctrl-C stops the children and restores the store's permissions.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from benchmarks.common.payload import PROVENANCE, emit
from benchmarks.common.server_process import stop_on_sigterm
from benchmarks.common.soak_faults import FAULT_NAMES, ClusterChild, DiskSamples, ReadOnlyDisk, RedisChild, ServeConfig, \
    SoakServer, Timeline, plan_faults, scan_store, serve_flags
from benchmarks.common.soak_report import COMPLETIONS, CORRUPT_LINE, bars, cross_tenant_summary, log_summary, \
    parse_metrics, report_text, summarize_integrity, summarize_requests
from benchmarks.common.soak_traffic import KINDS, Traffic, build_tenants

from cachesmith.cli_store import parse_bytes

TENANTS = ("alice", "bob", "carol")
READ_CHECK_RETRIES = 30


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="of open-loop traffic (after the capacity probe)")
    ap.add_argument("--load", type=float, default=1.5, help="arrival rate of completions / measured capacity")
    ap.add_argument("--capacity-s", type=float, default=30.0, help="closed-loop probe measuring capacity")
    ap.add_argument("--capacity-concurrency", type=int, default=16,
                    help="closed-loop clients: twice the server's batch, so batches fill and a queue forms")
    ap.add_argument("--faults", default=None,
                    help=f"comma-separated, in order, from {', '.join(FAULT_NAMES)} (or none; default: redis, "
                         f"readonly, kill, with --redis-cluster primary, readonly, kill)")
    ap.add_argument("--redis-cluster", action="store_true",
                    help="the store's redis is a local Redis Cluster (3 primaries, a replica each); the primary "
                         "fault SIGKILLs one of its primaries, which its replica replaces")
    ap.add_argument("--redis-down-s", type=float, default=20.0)
    ap.add_argument("--readonly-s", type=float, default=30.0)
    ap.add_argument("--tenant-mode", choices=["multi", "single"], default="multi",
                    help="multi: three named tenants in the key file; single: one bare key every client uses")
    ap.add_argument("--disk-max-bytes", default="128M", help="the disk tier's quota (small, so it evicts)")
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--tenant-max-bytes", default=None, help="passed to serve when given")
    ap.add_argument("--max-store-tokens-per-request", type=int, default=2048,
                    help="passed to serve (0: not passed, and no cap probes); cap probes send more new tokens "
                         "and expect 429 store_quota_exceeded")
    ap.add_argument("--server-arg", action="append", default=[], help="another serve flag (repeatable), "
                    "e.g. --server-arg=--max-batch-size=4")
    ap.add_argument("--max-connections", type=int, default=100, help="the client's connection pool")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress-s", type=float, default=10.0)
    ap.add_argument("--workdir", type=Path, default=None, help="default: a new folder under the temp dir")
    ap.add_argument("--keep-store", action="store_true", help="keep the disk tier and redis data at the end")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.faults is None:
        args.faults = "primary,readonly,kill" if args.redis_cluster else "redis,readonly,kill"
    args.fault_names = tuple(n for n in args.faults.split(",") if n and n != "none")
    if ("primary" in args.fault_names) != args.redis_cluster or ("redis" in args.fault_names and args.redis_cluster):
        ap.error("--faults: primary goes with --redis-cluster, redis with one redis-server")
    return args


def load_passages(min_words: int = 30, max_words: int = 160) -> list[str]:
    """The packaged workloads' Wikipedia passages of a chunk's usual size, as "title\\ntext"."""
    from cachesmith.workloads.corpus import load_corpus

    corpus = load_corpus()
    return [f"{p.title}\n{p.text}" for p in corpus.passages if min_words <= len(p.text.split()) <= max_words]


def machine_info() -> dict:
    cpu = "unknown"
    if Path("/proc/cpuinfo").exists():
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return {"cpu_count": os.cpu_count(), "cpu": cpu, "euid": os.geteuid(),
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]}


def serve_extra(args: argparse.Namespace) -> tuple[str, ...]:
    extra = []
    if args.tenant_max_bytes is not None:
        extra += ["--tenant-max-bytes", str(args.tenant_max_bytes)]
    if args.max_store_tokens_per_request:
        extra += ["--max-store-tokens-per-request", str(args.max_store_tokens_per_request)]
    return (*extra, *args.server_arg)


def write_keys(path: Path, mode: str) -> list[str]:
    """The API key file: `<tenant> <key>` lines, or one bare key (single mode). Returns each tenant's key."""
    import secrets

    keys = [f"sk-soak-{name}-{secrets.token_hex(8)}" for name in TENANTS]
    if mode == "single":
        keys = [keys[0]] * len(TENANTS)
        path.write_text(f"{keys[0]}\n")  # the key alone: a server before tenants reads the whole file as the key
    else:
        path.write_text("# cachesmith soak: three tenants\n" + "".join(f"{n} {k}\n" for n, k in zip(TENANTS, keys)))
    path.chmod(0o600)
    return keys


class Soak:
    """The children (redis, the server), the traffic and what the run found."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.store_root = workdir / "kv"
        self.store_root.mkdir(exist_ok=True)
        self.keys = write_keys(workdir / "api-keys.txt", args.tenant_mode)
        self.redis = ClusterChild(workdir) if args.redis_cluster else RedisChild(workdir)
        self.cfg = ServeConfig(self.store_root, self.redis.url, workdir / "api-keys.txt", args.disk_max_bytes,
                               args.max_queue, serve_extra(args))
        self.server_logs: list[Path] = []
        self.server: SoakServer | None = None
        self.readonly = ReadOnlyDisk(self.store_root)
        self.timeline = Timeline()
        self.disk = DiskSamples(parse_bytes(args.disk_max_bytes))
        self.integrity: dict = {}
        self.checks: list[asyncio.Task] = []
        self.metrics: dict = {}
        self.traffic: Traffic | None = None

    def start_server(self, port: int | None = None) -> None:
        log = self.workdir / f"server-{len(self.server_logs)}.log"
        self.server_logs.append(log)
        self.server = SoakServer(log, self.cfg, port)
        self.server.__enter__()

    def start(self) -> None:
        print(f"soak: work folder {self.workdir}", file=sys.stderr, flush=True)
        self.redis.start()
        self.start_server()

    def stop(self) -> None:
        self.readonly.restore()
        if self.server is not None:
            self.server.__exit__()
        self.redis.stop()

    # -- faults ----------------------------------------------------------------------------------
    async def run_faults(self, plan) -> None:
        for fault in plan:
            await asyncio.sleep(max(0.0, fault.at_s - self.timeline.now()))
            await getattr(self, f"_fault_{fault.name}")(fault.hold_s)

    async def _fault_redis(self, hold_s: float) -> None:
        window = self.timeline.open("redis_down")
        self.redis.kill()
        self.timeline.event("redis-server killed (SIGKILL)")
        await asyncio.sleep(hold_s)
        await asyncio.to_thread(self.redis.start)
        self.timeline.event("redis-server restarted", port=self.redis.port)
        self.timeline.close(window)

    async def _fault_primary(self, hold_s: float) -> None:
        window = self.timeline.open("primary_killed")  # not a store fault: no 503 is expected in it
        port = await asyncio.to_thread(self.redis.kill_primary)
        self.timeline.event("redis cluster primary killed (SIGKILL)", port=port)
        await asyncio.sleep(hold_s)
        await asyncio.to_thread(self.redis.restart, port)
        self.timeline.event("redis cluster node restarted (a replica now)", port=port)
        self.timeline.close(window)

    async def _fault_readonly(self, hold_s: float) -> None:
        if self.readonly.method is None:
            self.timeline.event("disk read-only skipped", note=self.readonly.note)
            return
        window = self.timeline.open("disk_readonly")
        await asyncio.to_thread(self.readonly.apply)
        self.timeline.event("store root made read-only", method=self.readonly.method)
        await asyncio.sleep(hold_s)
        await asyncio.to_thread(self.readonly.restore)
        self.timeline.event("store root writable again")
        self.timeline.close(window)

    async def _fault_kill(self, hold_s: float) -> None:
        self.metrics["before_kill"] = parse_metrics(await self.traffic.scrape_metrics())
        window = self.timeline.open("server_killed")
        pid = self.server.process.pid
        self.server.kill9()
        self.timeline.event("server killed (SIGKILL to its process group)", pid=pid)
        await asyncio.to_thread(self.start_server, self.server.port)
        self.timeline.event("server healthy again", pid=self.server.process.pid, log=str(self.server_logs[-1]))
        self.timeline.close(window)
        self.traffic.renew_client()  # no pooled connection of the killed server is reused
        self.checks.append(asyncio.create_task(self.check_integrity("after_restart")))

    # -- watchers --------------------------------------------------------------------------------
    async def sample_disk(self) -> None:
        while True:
            self.disk.add(*await asyncio.to_thread(scan_store, self.store_root))
            await asyncio.sleep(1.0)

    async def progress(self) -> None:
        while True:
            await asyncio.sleep(self.args.progress_s)
            recs = self.traffic.records
            count = lambda pred: sum(1 for r in recs if pred(r))  # noqa: E731
            print(f"[{self.timeline.now():7.1f} s] sent {self.traffic.sent}  done {len(recs)}  in flight "
                  f"{self.traffic.inflight}  | 2xx {count(lambda r: r.status.startswith('2'))}  429 "
                  f"{count(lambda r: r.status == '429')}  5xx {count(lambda r: r.status.startswith('5'))}  "
                  f"conn {count(lambda r: r.status in ('conn_error', 'timeout', 'stream_cut'))}  | acked "
                  f"{len(self.traffic.ledger.stored())}  | disk {self.disk.last_bytes() / 2**20:.1f} / "
                  f"{self.disk.quota / 2**20:.0f} MiB (max {self.disk.max_with_tmp_bytes / 2**20:.1f})  | "
                  f"fault: {self.timeline.active()}", file=sys.stderr, flush=True)

    # -- integrity -------------------------------------------------------------------------------
    def corrupt_prefixes(self) -> set[str]:
        found = set()
        for log in self.server_logs:
            if log.exists():
                found |= set(CORRUPT_LINE.findall(log.read_text(errors="replace")))
        return found

    def in_redis(self, ids: list[str]) -> dict[str, bool]:
        """Whether redis (one server or the cluster) holds each id; {} where it cannot say."""
        from cachesmith.kvstore.redis_tier import RedisTier

        tier = RedisTier(self.redis.url, timeout_s=5.0)
        try:
            if not tier.connected():
                return {}
            return {chunk_id: tier.contains(chunk_id) for chunk_id in ids}
        finally:
            tier.close()

    async def check_integrity(self, when: str, num_read: int = 30) -> None:
        """Every acknowledged chunk not deleted, by its tenant: GET /v1/chunks/{id}; then a sample
        of those found read through a completion (the data's checksums verified)."""
        tenants = {t.name: t for t in self.traffic.tenants}
        limit = asyncio.Semaphore(4)

        async def get(ack):
            async with limit:
                return ack, await self.traffic.get_status(tenants[ack.tenant], ack.chunk_id)

        self.timeline.event(f"integrity check ({when}) started", num_acked=len(self.traffic.ledger.stored()))
        checked = await asyncio.gather(*(get(a) for a in self.traffic.ledger.stored()))
        checked = [(a, s) for a, s in checked if a.state == "stored"]  # deleted by the soak meanwhile: skipped
        missing = [a.chunk_id for a, s in checked if s != "200"]
        result = summarize_integrity(checked, self.corrupt_prefixes(), await asyncio.to_thread(self.in_redis, missing),
                                     self.disk.evicted_seen, self.timeline.windows)
        found = [a for a, s in checked if s == "200"]
        sample = self.traffic.rng.sample(found, min(num_read, len(found)))
        result["read_check"] = await self.read_check(sample, tenants)
        self.integrity[when] = result
        self.timeline.event(f"integrity check ({when}) done", **{k: result[k] for k in ("num_checked", "ok", "lost")})

    async def read_check(self, sample, tenants) -> dict:
        failed, statuses = [], {}
        for ack in sample:
            for _ in range(READ_CHECK_RETRIES):  # a full queue answers 429: wait, not a failure
                status = await self.traffic.read_status(tenants[ack.tenant], ack.chunk_id)
                if status != "429":
                    break
                await asyncio.sleep(1.0)
            statuses[status] = statuses.get(status, 0) + 1
            if status == "404" and ack.state == "stored":
                failed.append({"id": ack.chunk_id, "tenant": ack.tenant,
                               "logged_unusable": ack.chunk_id[:12] in self.corrupt_prefixes()})
        return {"num_sampled": len(sample), "by_status": statuses, "num_failed": len(failed), "failed": failed}

    # -- the run ---------------------------------------------------------------------------------
    async def run(self) -> dict:
        args = self.args
        duration_s = args.minutes * 60
        plan = plan_faults(duration_s, args.fault_names, args.redis_down_s, args.readonly_s)
        passages = load_passages()
        tenants, shared = build_tenants(passages, list(TENANTS), self.keys, 40, 12, 400, args.seed)
        self.traffic = Traffic(self.server.url, tenants, shared, self.timeline.now, "smollm2-135m", args.seed,
                               args.max_store_tokens_per_request or None, args.max_connections)
        try:
            return await self._run(plan, duration_s)
        finally:
            await self.traffic.aclose()

    async def _run(self, plan, duration_s: float) -> dict:
        args = self.args
        print(f"soak: measuring capacity ({args.capacity_s:.0f} s, {args.capacity_concurrency} clients) ...",
              file=sys.stderr, flush=True)
        capacity, cap_records = await self.traffic.capacity(args.capacity_s, args.capacity_concurrency)
        if capacity <= 0:
            seen = Counter(f"{r.status} {r.code or ''} {r.detail or ''}"[:160] for r in cap_records)
            raise SystemExit(f"soak: no completion succeeded while measuring capacity ({dict(seen)}); see "
                             f"{self.server_logs[-1]}")
        kinds = self.traffic.kinds()
        rate = args.load * capacity * sum(kinds.values()) / sum(w for k, w in kinds.items() if k in COMPLETIONS)
        self.timeline.t0 = time.monotonic()
        self.timeline.event("traffic started", rate_per_s=round(rate, 3), capacity=round(capacity, 3))
        watchers = [asyncio.create_task(self.sample_disk()), asyncio.create_task(self.progress())]
        faults = asyncio.create_task(self.run_faults(plan))
        try:
            inflight = await self.traffic.open_loop(rate, duration_s)
            await faults
            self.timeline.event("arrivals stopped", in_flight=len(inflight))
            if inflight:
                await asyncio.wait(inflight, timeout=300)
            await asyncio.gather(*self.checks)
            await self.check_integrity("at_end")
            self.metrics["at_end"] = parse_metrics(await self.traffic.scrape_metrics())
        finally:
            for task in [*watchers, faults]:
                task.cancel()
        return self.payload(plan, capacity, cap_records, rate)

    def store_stats(self) -> str:
        exe = Path(sys.executable).with_name("cachesmith")
        cmd = [str(exe), "store", "stats", "--store-root", str(self.store_root), "--tiers", "disk", "redis",
               "--redis-url", self.redis.url, "--disk-max-bytes", self.args.disk_max_bytes]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return "store stats: timed out"
        return (done.stdout + done.stderr).strip()

    def payload(self, plan, capacity: float, cap_records, rate: float) -> dict:
        args, traffic = self.args, self.traffic
        cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("json",)}
        payload = {
            "config": {**cfg, "fault_names": list(args.fault_names), "tenants": list(TENANTS), "request_mix": KINDS,
                       "serve_flags": ["--port", str(self.server.port), *serve_flags(self.cfg)],
                       "model": "smollm2-135m", "workdir": str(self.workdir),
                       "pythonpath": os.environ.get("PYTHONPATH")},  # where cachesmith came from, when set
            "machine_info": machine_info(),
            "capacity": {"completions_per_s": round(capacity, 4), "seconds": args.capacity_s,
                         "concurrency": args.capacity_concurrency,
                         "by_status": dict(Counter(r.status for r in cap_records))},
            "rate_per_s": round(rate, 4),
            "requests": summarize_requests(traffic.records, self.timeline.windows),
            "faults": {"plan": [asdict(f) for f in plan], "windows": self.timeline.windows,
                       "events": self.timeline.events, "readonly_method": self.readonly.method,
                       "readonly_note": self.readonly.note},
            "integrity": {**self.integrity, "num_corrupt_evictions_logged": len(self.corrupt_prefixes()),
                          # acknowledged chunks by what the soak did with them; delete_unknown: the delete's
                          # answer never came (the killed window), so the chunk is checked by neither check
                          "ack_states": dict(Counter(a.state for a in traffic.ledger.acks.values()))},
            "cross_tenant": cross_tenant_summary(traffic.ledger, traffic.cross_enabled),
            "store": {"disk_quota_bytes": self.disk.quota, "num_samples": self.disk.num,
                      "max_entry_bytes": self.disk.max_entry_bytes, "max_with_tmp_bytes": self.disk.max_with_tmp_bytes,
                      "num_samples_over_quota": self.disk.num_over_quota,
                      "num_evictions_seen_on_disk": len(self.disk.evicted_seen), "metrics": self.metrics,
                      "store_stats_at_end": self.store_stats()},
            "server_logs": [log_summary(p) for p in self.server_logs],
        }
        payload["bars"] = bars(payload)
        return payload


def main(argv=None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    plan_faults(args.minutes * 60, args.fault_names, args.redis_down_s, args.readonly_s)  # fails before any start
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cachesmith-soak-"))
    commit = PROVENANCE["commit"]()  # at the start: HEAD may move while the soak runs
    soak = Soak(args, workdir)
    try:
        soak.start()
        payload = asyncio.run(soak.run())
    except KeyboardInterrupt:
        print(f"soak: interrupted; children stopped; logs in {workdir}", file=sys.stderr)
        return 130
    finally:
        soak.stop()
        if not args.keep_store:
            subprocess.run(["rm", "-rf", str(soak.store_root), str(soak.redis.dir)], check=False)
    emit({**payload, "commit": commit}, args.json, args.out, lambda: print(report_text(payload)))
    print(f"soak: logs kept in {workdir}", file=sys.stderr)
    return 1 if any(b["passed"] is False for b in payload["bars"]) else 0


if __name__ == "__main__":
    sys.exit(main())
