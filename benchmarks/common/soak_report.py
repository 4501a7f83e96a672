"""The soak's bookkeeping and its report: request records, acknowledged chunks and cross-tenant
attempts (`Record`, `Ack`, `Ledger`), and the pure functions that sum them up.

In: the records and ledger `soak_traffic` fills, the fault windows of `soak_faults.Timeline`, the
integrity checks' statuses. Out: the payload's sections (requests by status, phase and kind; 5xx
and connection failures outside the killed window; 429s by code; TTFT percentiles of admitted
requests; each acknowledged chunk classified as ok, evicted by the disk quota, corrupt or lost;
cross-tenant successes) and the printed table with each bar against its target.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cachesmith.kvstore.redis_tier import REDIS_RETRY_AFTER_S


@dataclass
class Record:
    kind: str
    tenant: str
    start_s: float
    end_s: float = 0.0
    status: str = ""
    code: str | None = None
    has_retry_after: bool | None = None
    ttft_client_s: float | None = None
    ttft_server_s: float | None = None
    detail: str | None = None


@dataclass
class Ack:
    chunk_id: str
    tenant: str
    t_s: float
    tiers: tuple[str, ...]
    is_shared_text: bool
    is_new: bool | None = None  # the server computed it for this upload (False: it already held it)
    state: str = "stored"  # stored | deleting | deleted | delete_unknown | deleted_by_other
    reacked: bool = False  # stored again while its delete was in flight: the outcome is unknown


@dataclass
class Ledger:
    acks: dict[tuple[str, str], Ack] = field(default_factory=dict)  # (tenant, id)
    shared_ids: dict[str, dict[str, str]] = field(default_factory=dict)  # shared text -> tenant -> id
    cross: Counter = field(default_factory=Counter)  # "<kind>:attempts" / "<kind>:successes"
    cross_details: list[dict] = field(default_factory=list)

    def ack(self, tenant: str, chunk_id: str, tiers, t_s: float, shared_text: str | None,
            is_new: bool | None = None) -> None:
        old = self.acks.get((tenant, chunk_id))
        if old is not None and old.state == "deleting":
            old.reacked = True
        elif old is None or old.state != "stored":
            self.acks[(tenant, chunk_id)] = Ack(chunk_id, tenant, t_s, tuple(tiers), shared_text is not None, is_new)
        if shared_text is not None:
            self.shared_ids.setdefault(shared_text, {})[tenant] = chunk_id

    def stored(self, tenant: str | None = None) -> list[Ack]:
        return [a for a in self.acks.values() if a.state == "stored" and (tenant is None or a.tenant == tenant)]

    def owners(self, chunk_id: str) -> set[str]:
        return {t for (t, i) in self.acks if i == chunk_id}

    def foreign(self, tenant: str) -> list[Ack]:
        """Entries other tenants were told are stored (and that this tenant never stored itself)."""
        return [a for a in self.stored() if a.tenant != tenant and tenant not in self.owners(a.chunk_id)]

    def note_cross(self, kind: str, prober: str, owner: str, chunk_id: str, status: str) -> bool:
        """Count one cross-tenant attempt; a 200 is a success (a read or delete across tenants)."""
        self.cross[f"{kind}:attempts"] += 1
        self.cross[f"{kind}:status:{status}"] += 1
        if status != "200":
            return False
        self.cross[f"{kind}:successes"] += 1
        self.cross_details.append({"kind": kind, "prober": prober, "owner": owner, "id": chunk_id})
        return True

    def note_list(self, prober: str, ids: list[str]) -> None:
        """One listing: every id in it that only other tenants were told of is a cross-tenant read."""
        self.cross["list:attempts"] += 1
        for chunk_id in ids:
            owners = self.owners(chunk_id)
            if owners and prober not in owners:
                self.cross["list:successes"] += 1
                self.cross_details.append({"kind": "list", "prober": prober, "owner": min(owners), "id": chunk_id})

    def id_collisions(self) -> int:
        """Identical texts that got the same id for two tenants: their entries are not kept apart."""
        return sum(len(set(ids.values())) < len(ids) for ids in self.shared_ids.values() if len(ids) > 1)



CORRUPT_LINE = re.compile(r"entry ([0-9a-f]{12})\S* is unusable")  # the store's log line on evicting one


# -- requests ------------------------------------------------------------------------------------
COMPLETIONS = ("chat", "completion", "by_id")
CONNECTION_FAILURES = ("conn_error", "timeout", "stream_cut")
MAX_EXAMPLES = 25


def is_5xx(rec: Record) -> bool:
    """A server error: a 5xx status, or a server_error event inside a 200 stream."""
    return rec.status.startswith("5") or (rec.status == "stream_error" and rec.code == "server_error")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def phase_of(rec: Record, windows: list[dict], open_end_s: float = float("inf")) -> str:
    """The fault window a request's [start, end] overlaps ("server_killed" first: failures there are
    expected), else "steady". A window still open counts as ending at `open_end_s`."""
    hits = [w["name"] for w in windows
            if rec.start_s <= (open_end_s if w["end_s"] is None else w["end_s"]) and rec.end_s >= w["start_s"]]
    if "server_killed" in hits:
        return "server_killed"
    return hits[0] if hits else "steady"


STORE_FAULTS = ("redis_down", "disk_readonly")


def is_store_refusal(rec: Record, windows: list[dict]) -> bool:
    """A 503 `store_unavailable` while a store tier is down or read-only, or within the tier's
    back-off after it (the server tries the tier again only then): the server refusing what that
    tier would have to do (a delete it cannot carry there), the entry kept, with Retry-After.
    Expected there, so not among the unexpected 5xx; anywhere else it is one."""
    if rec.status != "503" or rec.code != "store_unavailable":
        return False
    return any(w["name"] in STORE_FAULTS and rec.end_s >= w["start_s"]
               and (w["end_s"] is None or rec.start_s <= w["end_s"] + REDIS_RETRY_AFTER_S) for w in windows)


def _example(rec: Record, phase: str) -> dict:
    return {k: v for k, v in {**asdict(rec), "phase": phase}.items() if v is not None}


def summarize_requests(records: list[Record], windows: list[dict]) -> dict:
    phases = [phase_of(r, windows) for r in records]
    by_phase: dict[str, Counter] = {}
    by_kind: dict[str, Counter] = {}
    for rec, phase in zip(records, phases):
        by_phase.setdefault(phase, Counter())[rec.status] += 1
        by_kind.setdefault(rec.kind, Counter())[rec.status] += 1
    outside = [(r, p) for r, p in zip(records, phases) if p != "server_killed"]
    refusals = [(r, p) for r, p in outside if is_store_refusal(r, windows)]
    server_errors = [(r, p) for r, p in outside if is_5xx(r) and not is_store_refusal(r, windows)]
    dropped = [(r, p) for r, p in outside if r.status in CONNECTION_FAILURES]
    return {"num_requests": len(records), "by_status": dict(Counter(r.status for r in records)),
            "by_phase": {p: dict(c) for p, c in by_phase.items()}, "by_kind": {k: dict(c) for k, c in by_kind.items()},
            "num_5xx_outside_killed_window": len(server_errors),
            "num_503_store_unavailable_in_store_faults": len(refusals),
            "examples_503_store_unavailable_in_store_faults": [_example(r, p) for r, p in refusals[:MAX_EXAMPLES]],
            "examples_5xx_outside_killed_window": [_example(r, p) for r, p in server_errors[:MAX_EXAMPLES]],
            "num_connection_failures_outside_killed_window": len(dropped),
            "examples_connection_failures_outside_killed_window": [_example(r, p) for r, p in dropped[:MAX_EXAMPLES]],
            "num_failures_in_killed_window": sum(p == "server_killed" and (is_5xx(r) or r.status in CONNECTION_FAILURES)
                                                 for r, p in zip(records, phases)),
            **_rate_limits(records), "ttft": ttft_summary(records), **_probes(records, phases)}


def _rate_limits(records: list[Record]) -> dict:
    limited = [r for r in records if r.status == "429"]
    return {"num_429_by_code": dict(Counter(r.code or "none" for r in limited)),
            "num_429_queue_full_without_retry_after": sum(r.code == "queue_full" and not r.has_retry_after
                                                          for r in limited),
            "num_429_slo_unattainable_without_retry_after": sum(r.code == "slo_unattainable" and not r.has_retry_after
                                                                for r in limited)}


def ttft_summary(records: list[Record]) -> dict:
    """Percentiles of admitted streamed completions (answered 200 to the end): the client's clock
    (request sent to first event, HTTP and queueing included) and the server's own."""
    ok = [r for r in records if r.kind in COMPLETIONS and r.status == "200"]
    out = {"num_admitted": len(ok)}
    for clock in ("client", "server"):
        values = [getattr(r, f"ttft_{clock}_s") for r in ok if getattr(r, f"ttft_{clock}_s") is not None]
        for q in (50, 99):
            value = percentile(values, q)
            out[f"{clock}_p{q}_s"] = None if value is None else round(value, 4)
    return out


def _probes(records: list[Record], phases: list[str]) -> dict:
    noauth = [r for r in records if r.kind == "noauth"]
    caps = [r for r in records if r.kind == "cap_probe"]
    missing = [(r, p) for r, p in zip(records, phases) if (r.detail or "").startswith("own_")]
    return {"noauth_by_status": dict(Counter(r.status for r in noauth)),
            "num_auth_bypass": sum(r.status.startswith("2") for r in noauth),
            "cap_probe_by_status": dict(Counter(f"{r.status}:{r.code}" if r.code else r.status for r in caps)),
            "num_cap_not_enforced": sum(r.status.startswith("2") for r in caps),
            # lost, outside every fault window (a redis outage may hide an entry only redis holds, for a while)
            "num_own_lost_steady": sum(p == "steady" and r.detail.startswith("own_lost") for r, p in missing),
            "own_missing_by_phase": dict(Counter(f"{p}:{r.detail.split()[0]}" for r, p in missing)),
            "examples_own_missing": [_example(r, p) for r, p in missing[:MAX_EXAMPLES]],
            "num_soak_errors": sum(r.status == "soak_error" for r in records),
            "examples_soak_errors": [r.detail for r in records if r.status == "soak_error"][:MAX_EXAMPLES]}


# -- acknowledged chunks -------------------------------------------------------------------------
def classify(ack: Ack, status: str, corrupt_prefixes: set[str]) -> str:
    """ok; unchecked (the check itself failed); corrupt (the server logged the entry unusable);
    evicted_disk_quota (acknowledged with disk as its only durable tier, which evicts least recently
    used entries past its quota); lost (acknowledged, not deleted, and gone otherwise: redis held it,
    and redis here persists every write, or no durable tier held it at all)."""
    if status == "200":
        return "ok"
    if status != "404":
        return "unchecked"
    if ack.chunk_id[:12] in corrupt_prefixes:
        return "corrupt"
    durable = {"disk", "redis"} & set(ack.tiers)
    return "evicted_disk_quota" if durable == {"disk"} else "lost"


def summarize_integrity(checked: list[tuple[Ack, str]], corrupt_prefixes: set[str], in_redis: dict[str, bool],
                        evicted_seen: set[str], windows: list[dict] = ()) -> dict:
    counts, details = Counter(), []
    for ack, status in checked:
        verdict = classify(ack, status, corrupt_prefixes)
        counts[verdict] += 1
        if verdict != "ok":
            details.append({"id": ack.chunk_id, "tenant": ack.tenant, "verdict": verdict, "status": status,
                            "acknowledged_s": round(ack.t_s, 1), "ack_tiers": list(ack.tiers),
                            "ack_is_new": ack.is_new, "ack_phase": phase_of(Record("", "", ack.t_s, ack.t_s), windows),
                            "in_redis_now": in_redis.get(ack.chunk_id),
                            "eviction_seen_on_disk": ack.chunk_id in evicted_seen})
    return {"num_checked": len(checked), **{k: counts[k] for k in ("ok", "evicted_disk_quota", "corrupt", "lost",
                                                                     "unchecked")},
            "not_ok": details[:200]}


def cross_tenant_summary(ledger: Ledger, is_multi: bool) -> dict:
    if not is_multi:
        return {"measured": False, "note": "single-tenant mode: one key for every client, nothing to keep apart"}
    kinds = sorted({k.split(":")[0] for k in ledger.cross})
    per_kind = {k: {"attempts": ledger.cross[f"{k}:attempts"], "successes": ledger.cross[f"{k}:successes"],
                    "by_status": {name.split(":")[2]: n for name, n in ledger.cross.items()
                                  if name.startswith(f"{k}:status:")}} for k in kinds}
    return {"measured": True, "num_successes": sum(v["successes"] for v in per_kind.values()), "by_kind": per_kind,
            "identical_text_id_collisions": ledger.id_collisions(), "successes": ledger.cross_details[:100]}


# -- the server's own account ------------------------------------------------------------------
def log_summary(path: Path) -> dict:
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = text.splitlines()
    errors = [line for line in lines if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line]
    return {"path": str(path), "num_lines": len(lines), "num_error_lines": len(errors),
            "num_warning_lines": sum(line.startswith("WARNING") for line in lines),
            "num_corrupt_evictions": len(CORRUPT_LINE.findall(text)), "first_errors": errors[:10]}


def parse_metrics(text: str) -> dict:
    """The store's series of a /metrics scrape (hits, misses, tier up, and anything about evictions or
    corrupt entries the server exposes)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not any(w in line for w in ("store", "evict", "corrupt", "quota", "rejected", "shed", "estimate")):
            continue
        name, _, value = line.rpartition(" ")
        out[name.replace('model_name="smollm2-135m",', "").replace('{model_name="smollm2-135m"}', "")] = float(value)
    return out


# -- bars and the printed table ------------------------------------------------------------------
def bars(payload: dict) -> list[dict]:
    """Each bar: what, value, target, and whether it passed (None where it has no target or was not
    measured)."""
    req, integ, cross, store = payload["requests"], payload["integrity"], payload["cross_tenant"], payload["store"]
    rows = [("5xx outside the killed window (but store_unavailable in a store fault)",
             req["num_5xx_outside_killed_window"], 0),
            ("connection failures outside the killed window", req["num_connection_failures_outside_killed_window"], 0),
            ("own chunks lost (404) outside fault windows", req["num_own_lost_steady"], 0)]
    for when in ("after_restart", "at_end"):
        check = integ.get(when)
        for verdict in ("lost", "corrupt"):
            rows.append((f"acknowledged chunks {verdict} ({when.replace('_', ' ')})",
                         None if check is None else check[verdict], 0))
    reads = [integ[w]["read_check"]["num_failed"] for w in ("after_restart", "at_end") if w in integ]
    rows += [("stored chunks failing a read-through", sum(reads) if reads else None, 0),
             ("entries the server logged unusable (evicted corrupt)", integ["num_corrupt_evictions_logged"], 0),
             ("cross-tenant reads", cross.get("num_successes") if cross["measured"] else None, 0),
             ("identical texts sharing an id across tenants",
              cross.get("identical_text_id_collisions") if cross["measured"] else None, 0),
             ("requests without the key answered 2xx", req["num_auth_bypass"], 0),
             ("429 queue_full without Retry-After", req["num_429_queue_full_without_retry_after"], 0),
             ("429 slo_unattainable without Retry-After",
              req.get("num_429_slo_unattainable_without_retry_after"), 0),
             ("cap probes answered 2xx (cap not enforced)", req["num_cap_not_enforced"], 0)]
    out = [{"bar": name, "value": value, "target": target, "passed": None if value is None else value <= target}
           for name, value, target in rows]
    out.append({"bar": "503 store_unavailable in a store fault (retryable refusals)",
                "value": req.get("num_503_store_unavailable_in_store_faults"), "target": "-", "passed": None})
    quota = store["disk_quota_bytes"]
    out.append({"bar": "max disk tier bytes (entries + temporary files)", "value": store["max_with_tmp_bytes"],
                "target": f"<= {quota}", "passed": store["max_with_tmp_bytes"] <= quota})
    ttft = req["ttft"]
    for clock in ("client", "server"):
        out.append({"bar": f"p99 TTFT of admitted completions, {clock} clock (s)", "value": ttft[f"{clock}_p99_s"],
                    "target": "-", "passed": None})
    return out


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(lines)


def report_text(payload: dict) -> str:
    req = payload["requests"]
    statuses = sorted(req["by_status"], key=lambda s: (not s[0].isdigit(), s))
    phases = list(req["by_phase"])
    by_phase = [[p, sum(req["by_phase"][p].values()), *(req["by_phase"][p].get(s, 0) for s in statuses)]
                for p in phases]
    by_phase.append(["all", req["num_requests"], *(req["by_status"][s] for s in statuses)])
    bar_rows = [[b["bar"], b["value"], b["target"], {True: "yes", False: "NO", None: "-"}[b["passed"]]]
                for b in payload["bars"]]
    cap = payload["capacity"]
    head = (f"soak: {payload['config']['minutes']} min at {payload['config']['load']}x capacity "
            f"({cap['completions_per_s']:.3f} completions/s measured; {payload['rate_per_s']:.3f} requests/s sent), "
            f"tenants: {payload['config']['tenant_mode']}")
    faults = "\n".join(f"  {w['name']:<14} {w['start_s']:>8.1f} s -> {_fmt(w['end_s']):>8} s" for w in payload["faults"]["windows"])
    by_kind = [[k, sum(c.values()), *(c.get(s, 0) for s in statuses)] for k, c in sorted(req["by_kind"].items())]
    return "\n".join([head, "", "requests by phase and status", table(by_phase, ["phase", "n", *statuses]), "",
                      "requests by kind and status", table(by_kind, ["kind", "n", *statuses]), "",
                      "fault windows (s since the traffic started)", faults or "  none", "",
                      table(bar_rows, ["bar", "value", "target", "pass"])])
