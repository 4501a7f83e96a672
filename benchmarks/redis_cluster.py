"""The shared store on a Redis Cluster against one redis server: capacity, failover, replicated
writes and reads, through the store's redis tier (`kvstore.redis_tier`).

One run (about 2 minutes on 2 cores), local servers on loopback (`benchmarks/common/redis_cluster.py`):
- capacity: entries of `--entry-kib` written well past the bound into one redis-server with
  `maxmemory` M and into a cluster of 3 primaries (each with a replica) of `maxmemory` M each;
  the entries held at the end and their ratio (bar: >= 2.7x);
- failover: seconds from a primary's SIGKILL until every entry it served is read again through the
  tier, each written as an upload is (a replica's copy confirmed), `--failovers` times on a fresh
  cluster (bar: `cluster-node-timeout` + 5 s), and how many of those entries were lost (bar: 0);
- replicated writes: median milliseconds of a `put` and of a `put_replicated` (WAIT for one replica);
- reads: entry reads per second through the tier by 1, 2 and 4 reader processes, on one server and
  on the cluster (reported, not barred: the readers and every node share 2 cores here).
`--out FILE` writes the payload (`docs/bench/redis_cluster.json`).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common.payload import emit, print_table
from benchmarks.common.redis_cluster import NODE_TIMEOUT_MS, start_cluster, start_single
from cachesmith.kvstore.redis_tier import RedisTier

MAX_MIB = 32  # maxmemory of every node
NUM_KEYS = 60  # entries written before a failover


def key(i: int) -> str:
    return f"{i:064x}"


def capacity(entry: bytes, workdir: Path) -> dict:
    """Entries held by one server and by 3 primaries, each bounded at MAX_MIB, after writing 3x what
    the cluster can hold."""
    num_writes = 3 * 3 * (MAX_MIB << 20) // len(entry)
    held = {}
    for name, start in (("one server", lambda: start_single(workdir / "one", MAX_MIB << 20)),
                        ("3 primaries", lambda: start_cluster(workdir / "three", MAX_MIB << 20))):
        servers = start()
        try:
            tier = RedisTier(servers.url)
            for i in range(num_writes):
                tier.put(key(i), entry)
            held[name] = tier.usage().num_entries
        finally:
            servers.stop()
    return {"maxmemory_mib": MAX_MIB, "entry_bytes": len(entry), "num_written": num_writes, "held": held,
            "ratio": held["3 primaries"] / max(1, held["one server"])}


def failover(entry: bytes, workdir: Path, run: int) -> dict:
    cluster = start_cluster(workdir / f"failover-{run}")
    try:
        tier = RedisTier(cluster.url)
        acked = [key(i) for i in range(NUM_KEYS) if tier.put_replicated(key(i), entry)]
        victim = cluster.primaries()[run % 3]
        lost = {k for k in acked if tier.client.get_node_from_key(RedisTier.PREFIX + k).port == victim}
        num_on_victim = len(lost)
        cluster.kill(victim)
        start = time.monotonic()
        while lost and time.monotonic() - start < 60:
            lost = {k for k in lost if tier.source(k) is None}
            time.sleep(0.05)
        return {"run": run, "num_acked": len(acked), "num_on_victim": num_on_victim, "num_lost": len(lost),
                "seconds_to_read_again": round(time.monotonic() - start, 2)}
    finally:
        cluster.stop()


def write_ms(entry: bytes, workdir: Path, num: int = 100) -> dict:
    cluster = start_cluster(workdir / "writes")
    try:
        tier = RedisTier(cluster.url)
        times = {"put": [], "put_replicated": []}
        for i in range(num):
            for name, write in (("put", tier.put), ("put_replicated", tier.put_replicated)):
                t = time.perf_counter()
                write(key(i if name == "put" else num + i), entry)
                times[name].append(1e3 * (time.perf_counter() - t))
        return {name: round(statistics.median(ms), 3) for name, ms in times.items()}
    finally:
        cluster.stop()


def _reader(url: str, num_keys: int, seconds: float, counts) -> None:
    tier, done, end = RedisTier(url), 0, time.monotonic() + seconds
    while time.monotonic() < end:
        source = tier.source(key(done % num_keys))
        buffer = memoryview(bytearray(source.size))
        source.readinto(0, buffer)
        done += 1
    counts.put(done)


def reads(entry: bytes, workdir: Path, seconds: float = 3.0) -> list[dict]:
    rows = []
    for name, start in (("one server", lambda: start_single(workdir / "reads-one")),
                        ("3 primaries", lambda: start_cluster(workdir / "reads-three"))):
        servers = start()
        try:
            tier = RedisTier(servers.url)
            for i in range(64):
                tier.put(key(i), entry)
            for num_readers in (1, 2, 4):
                counts = mp.Queue()
                procs = [mp.Process(target=_reader, args=(servers.url, 64, seconds, counts)) for _ in range(num_readers)]
                for p in procs:
                    p.start()
                total = sum(counts.get(timeout=60) for _ in procs)
                for p in procs:
                    p.join()
                rows.append({"store": name, "readers": num_readers, "reads_per_s": round(total / seconds, 1),
                             "mib_per_s": round(total * len(entry) / seconds / 2**20, 1)})
        finally:
            servers.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entry-kib", type=int, default=256)
    ap.add_argument("--failovers", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    entry = b"\x5a" * (args.entry_kib << 10)
    with tempfile.TemporaryDirectory(prefix="cachesmith-redis-cluster-") as tmp:
        workdir = Path(tmp)
        cap = capacity(entry, workdir)
        runs = [failover(entry, workdir, r) for r in range(args.failovers)]
        writes = write_ms(entry, workdir)
        read_rows = reads(entry, workdir)
    limit_s = NODE_TIMEOUT_MS / 1e3 + 5
    bars = [{"bar": "3 primaries hold >= 2.7x one server", "value": round(cap["ratio"], 2), "passed": cap["ratio"] >= 2.7},
            {"bar": f"failed slots read again within {limit_s:g} s", "value": max(r["seconds_to_read_again"] for r in runs),
             "passed": all(r["seconds_to_read_again"] <= limit_s and not r["num_lost"] for r in runs)},
            {"bar": "no acknowledged upload lost", "value": sum(r["num_lost"] for r in runs),
             "passed": not any(r["num_lost"] for r in runs)}]
    payload = {"capacity": cap, "failovers": runs, "node_timeout_ms": NODE_TIMEOUT_MS, "write_ms": writes,
               "reads": read_rows, "bars": bars, "passed": all(b["passed"] for b in bars)}

    def tables() -> None:
        print(f"capacity at maxmemory {MAX_MIB} MiB a node, {len(entry) >> 10} KiB entries: {cap['held']} "
              f"({cap['ratio']:.2f}x)")
        print_table(runs, ["run", "num_acked", "num_on_victim", "num_lost", "seconds_to_read_again"])
        print(f"write ms (median of 100): {writes}")
        print_table(read_rows, ["store", "readers", "reads_per_s", "mib_per_s"])
        print_table(bars, ["bar", "value", "passed"])

    emit(payload, args.json, args.out, tables)


if __name__ == "__main__":
    main()
