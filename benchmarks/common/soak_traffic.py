"""The soak's clients: three tenants' documents, what each has stored, and the requests they send.

In: corpus passages, the tenants' keys, a base URL. Out: `Record`s (one per request: kind, tenant,
times since the traffic started, status, error code, Retry-After, TTFT on both clocks) and the
`Ledger`: every chunk id a tenant was told is stored (POST /v1/chunks), which of them the soak
deleted, and every cross-tenant attempt (a GET, DELETE, listing or completion by id reaching an
entry of another tenant) with whether it succeeded. Statuses are strings: "200", "429", ...,
"conn_error", "timeout", "stream_cut" (the stream ended without [DONE]) and "stream_error" (an
error event inside a 200 stream; `code` says server_error or not).
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from benchmarks.common.soak_report import Ack, Ledger, Record, classify
from benchmarks.common.sse import Stream

QUESTIONS = ("Summarize the documents in one sentence.", "What is the first document about?",
             "Name one place mentioned in the documents.", "Which year appears in the documents?")
KINDS = {  # kind -> share of arrivals
    "chat": 0.34, "completion": 0.25, "by_id": 0.05, "upload": 0.10, "get_own": 0.05, "delete_own": 0.03,
    "list_own": 0.02, "cross": 0.12, "metrics": 0.01, "noauth": 0.01, "cap_probe": 0.02}
COMPLETION_KINDS = ("chat", "completion", "by_id")


@dataclass
class Tenant:
    name: str
    key: str
    docs: list[str]  # texts its completions carry
    uploads: list[str]  # fresh texts for POST /v1/chunks, taken in order
    next_upload: int = 0

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def fresh(self, n: int) -> list[str]:
        texts = [self.uploads[(self.next_upload + i) % len(self.uploads)] for i in range(n)]
        self.next_upload += n
        return texts


def build_tenants(passages: list[str], names: list[str], keys: list[str], num_docs: int, num_shared: int,
                  num_uploads: int, seed: int = 0) -> tuple[list[Tenant], list[str]]:
    """Disjoint passages per tenant, plus `num_shared` texts every tenant sends (identical texts:
    isolation must still keep their entries apart)."""
    rng = random.Random(seed)
    pool = list(passages)
    rng.shuffle(pool)
    need = num_shared + len(names) * (num_docs + num_uploads)
    if len(pool) < need:
        raise ValueError(f"{len(pool)} passages; the tenants need {need}")
    shared, pool = pool[:num_shared], pool[num_shared:]
    tenants = []
    for name, key in zip(names, keys):
        docs, uploads = pool[:num_docs], pool[num_docs:num_docs + num_uploads]
        pool = pool[num_docs + num_uploads:]
        tenants.append(Tenant(name, key, docs, uploads))
    return tenants, shared


def error_code(response: httpx.Response) -> str | None:
    try:
        return (response.json().get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


def status_of(exc: Exception) -> str:
    return "timeout" if isinstance(exc, httpx.TimeoutException) else "conn_error"


class Traffic:
    """One client per server start (`client` is replaced after a restart), the tenants and the ledger."""

    def __init__(self, url: str, tenants: list[Tenant], shared: list[str], clock, model: str, seed: int = 0,
                 cap_tokens: int | None = None, max_connections: int = 100, transport=None) -> None:
        self.url, self.tenants, self.shared, self.clock, self.model = url, tenants, shared, clock, model
        self.rng = random.Random(seed)
        self.cap_tokens = cap_tokens  # --max-store-tokens-per-request, when the server has one
        self.cross_enabled = len({t.key for t in tenants}) > 1  # one key for all: no tenants to keep apart
        self.sent = 0
        self.max_connections, self.transport = max_connections, transport  # transport: tests' fake server
        self.ledger = Ledger()
        self.records: list[Record] = []
        self.inflight = 0
        self.metrics_text = ""
        self.client = self.new_client()
        self.old_clients: list[httpx.AsyncClient] = []

    def new_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=32)
        return httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(180.0, connect=10.0), limits=limits,
                                 transport=self.transport)

    def renew_client(self) -> None:
        self.old_clients.append(self.client)
        self.client = self.new_client()

    async def aclose(self) -> None:
        for client in [self.client, *self.old_clients]:
            await client.aclose()

    # -- bodies ----------------------------------------------------------------------------------
    def _documents(self, tenant: Tenant) -> list[str]:
        k = self.rng.choice((2, 3))
        return [self.rng.choice(self.shared if self.rng.random() < 0.2 else tenant.docs) for _ in range(k)]

    def body(self, tenant: Tenant, kind: str, documents: list | None = None) -> dict:
        docs = documents if documents is not None else self._documents(tenant)
        question = self.rng.choice(QUESTIONS)
        body = {"model": self.model, "documents": docs, "max_tokens": self.rng.randint(8, 16),
                "slo_ms": self.rng.choice((1000, 2000, 4000)), "stream": True}
        if kind == "completion":
            return {**body, "prompt": f"Question: {question}\nAnswer:"}
        return {**body, "messages": [{"role": "user", "content": question}]}

    # -- one request -----------------------------------------------------------------------------
    async def send(self, rec: Record, method: str, path: str, headers: dict | None, **kw) -> httpx.Response | None:
        self.inflight += 1
        try:
            r = await self.client.request(method, path, headers=headers, **kw)
            rec.status, rec.code = str(r.status_code), (error_code(r) if r.status_code >= 400 else None)
            if r.status_code == 429:
                rec.has_retry_after = "retry-after" in r.headers
            return r
        except httpx.HTTPError as exc:
            rec.status, rec.detail = status_of(exc), f"{type(exc).__name__}: {exc}"[:200]
            return None
        finally:
            self.inflight -= 1
            rec.end_s = self.clock()
            self.records.append(rec)

    async def stream(self, rec: Record, path: str, tenant: Tenant, body: dict) -> None:
        """A streamed completion: client TTFT to the first event, server TTFT from the last chunk."""
        self.inflight += 1
        stream = Stream("line", time.monotonic)  # TTFT to the first line of the stream, [DONE] too
        try:
            async with self.client.stream("POST", path, json=body, headers=tenant.headers) as r:
                rec.status = str(r.status_code)
                if r.status_code != 200:
                    await r.aread()
                    rec.code, rec.has_retry_after = error_code(r), "retry-after" in r.headers
                    rec.detail = r.text[:300] if r.status_code >= 500 else None
                    return
                await self._events(rec, r, stream)
        except httpx.HTTPError as exc:
            rec.status = "stream_cut" if rec.status == "200" else status_of(exc)
            rec.detail = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            self.inflight -= 1
            rec.end_s = self.clock()
            self.records.append(rec)

    async def _events(self, rec: Record, r: httpx.Response, stream: Stream) -> None:
        try:
            await stream.read(r.aiter_lines())
        finally:  # what came before a cut stream is recorded too
            rec.ttft_client_s = stream.ttft_s
            if stream.errors:
                rec.status, rec.code = "stream_error", stream.errors[-1].get("type")
                rec.detail = str(stream.errors[-1].get("message"))[:300]
            if stream.final is not None:
                rec.ttft_server_s = stream.final["ttft_ms"] / 1e3
        if not stream.is_done and rec.status == "200":
            rec.status = "stream_cut"

    # -- the kinds of request --------------------------------------------------------------------
    def kinds(self) -> dict[str, float]:
        """The request mix: without tenants no cross-tenant probes, without a token cap no cap probes."""
        return {k: w for k, w in KINDS.items() if not (k == "cross" and not self.cross_enabled)
                and not (k == "cap_probe" and self.cap_tokens is None)}

    async def op(self, kind: str, tenant: Tenant) -> None:
        try:
            await getattr(self, f"_op_{kind}")(tenant)
        except Exception as exc:  # the soak's own fault: recorded and shown, the run goes on
            self.records.append(Record("soak_error", tenant.name, self.clock(), self.clock(), "soak_error",
                                       detail=f"{kind}: {type(exc).__name__}: {exc}"[:300]))

    async def _op_chat(self, tenant: Tenant) -> None:
        await self.stream(Record("chat", tenant.name, self.clock()), "/v1/chat/completions", tenant,
                          self.body(tenant, "chat"))

    async def _op_completion(self, tenant: Tenant) -> None:
        await self.stream(Record("completion", tenant.name, self.clock()), "/v1/completions", tenant,
                          self.body(tenant, "completion"))

    async def _op_by_id(self, tenant: Tenant) -> None:
        own = self.ledger.stored(tenant.name)
        if not own:
            return await self._op_chat(tenant)
        ack = self.rng.choice(own)
        rec = Record("by_id", tenant.name, self.clock())
        docs = [{"id": ack.chunk_id}, self.rng.choice(tenant.docs)]
        await self.stream(rec, "/v1/chat/completions", tenant, self.body(tenant, "chat", docs))
        self._note_own_missing(rec, ack)

    def _note_own_missing(self, rec: Record, ack: Ack) -> None:
        """A 404 for an entry the tenant was told is stored and has not deleted: "own_lost", or
        "own_evicted_disk_quota" where disk was its only durable tier (`soak_report.classify`)."""
        if rec.status == "404" and ack.state == "stored":
            rec.detail = (f"own_{classify(ack, '404', set())} {ack.chunk_id} (acknowledged at {ack.t_s:.1f} s, "
                          f"tiers {'+'.join(ack.tiers)})")

    async def _op_upload(self, tenant: Tenant) -> None:
        shared = self.rng.random() < 0.2
        texts = [self.rng.choice(self.shared)] if shared else tenant.fresh(self.rng.choice((1, 2)))
        rec = Record("upload", tenant.name, self.clock())
        r = await self.send(rec, "POST", "/v1/chunks", tenant.headers, json={"documents": texts})
        if r is not None and r.status_code == 200:
            for text, item in zip(texts, r.json()["data"]):
                self.ledger.ack(tenant.name, item["id"], item.get("tiers", ()), rec.end_s, text if shared else None,
                                item.get("is_new"))

    async def _op_get_own(self, tenant: Tenant) -> None:
        own = self.ledger.stored(tenant.name)
        if own:
            ack = self.rng.choice(own)
            rec = Record("get_own", tenant.name, self.clock())
            await self.send(rec, "GET", f"/v1/chunks/{ack.chunk_id}", tenant.headers)
            self._note_own_missing(rec, ack)

    async def _op_delete_own(self, tenant: Tenant) -> None:
        own = self.ledger.stored(tenant.name)
        if not own:
            return
        ack = self.rng.choice(own)
        ack.state = "deleting"
        rec = Record("delete_own", tenant.name, self.clock())
        r = await self.send(rec, "DELETE", f"/v1/chunks/{ack.chunk_id}", tenant.headers)
        if rec.status == "200":
            ack.state = "delete_unknown" if ack.reacked else "deleted"
        else:
            ack.state = "delete_unknown" if r is None else "stored"
        self._note_own_missing(rec, ack)

    async def _op_list_own(self, tenant: Tenant) -> None:
        ids, after = [], None
        while True:
            rec = Record("list_own", tenant.name, self.clock())
            params = {"limit": 1000, **({"after": after} if after else {})}
            r = await self.send(rec, "GET", "/v1/chunks", tenant.headers, params=params)
            if r is None or r.status_code != 200:
                return
            page = r.json()
            ids += [d["id"] for d in page["data"]]
            if not page.get("has_more") or not page["data"]:
                break
            after = page["data"][-1]["id"]
        if self.cross_enabled:
            self.ledger.note_list(tenant.name, ids)

    async def _op_cross(self, tenant: Tenant) -> None:
        foreign = self.ledger.foreign(tenant.name)
        if not foreign:
            return
        ack, probe = self.rng.choice(foreign), self.rng.choice(("get", "delete", "ref"))
        rec = Record(f"cross_{probe}", tenant.name, self.clock())
        if probe == "ref":
            body = {**self.body(tenant, "chat", [{"id": ack.chunk_id}]), "stream": False, "max_tokens": 1}
            await self.send(rec, "POST", "/v1/chat/completions", tenant.headers, json=body)
        else:
            await self.send(rec, probe.upper(), f"/v1/chunks/{ack.chunk_id}", tenant.headers)
        if self.ledger.note_cross(probe, tenant.name, ack.tenant, ack.chunk_id, rec.status) and probe == "delete":
            ack.state = "deleted_by_other"

    async def _op_metrics(self, tenant: Tenant) -> None:
        r = await self.send(Record("metrics", tenant.name, self.clock()), "GET", "/metrics", tenant.headers)
        if r is not None and r.status_code == 200:
            self.metrics_text = r.text

    async def scrape_metrics(self) -> str:
        """/metrics now, outside the records ("" when it does not answer)."""
        try:
            r = await self.client.get("/metrics", headers=self.tenants[0].headers)
        except httpx.HTTPError:
            return ""
        return r.text if r.status_code == 200 else ""

    async def _op_noauth(self, tenant: Tenant) -> None:
        path = self.rng.choice(("/v1/chunks", "/metrics", "/v1/models", "/docs"))
        headers = self.rng.choice((None, {"Authorization": "Bearer not-a-key"}))
        await self.send(Record("noauth", tenant.name, self.clock(), detail=f"GET {path}"), "GET", path, headers)

    async def _op_cap_probe(self, tenant: Tenant) -> None:
        """New text past --max-store-tokens-per-request (more words than the cap: each word is at
        least one token): the answer must be 429 store_quota_exceeded, and nothing stored."""
        texts = []
        while sum(len(t.split()) for t in texts) <= self.cap_tokens:
            texts += tenant.fresh(1)
        body = {**self.body(tenant, "chat", ["\n".join(texts)]), "stream": False, "max_tokens": 1}
        await self.send(Record("cap_probe", tenant.name, self.clock()), "POST", "/v1/chat/completions",
                        tenant.headers, json=body)

    # -- load ------------------------------------------------------------------------------------
    async def capacity(self, seconds: float, concurrency: int) -> tuple[float, list[Record]]:
        """Completions per second a closed loop of `concurrency` clients sustains (the same bodies
        as the soak's chats); the records it made are taken out of `records`."""
        end, done = time.monotonic() + seconds, 0

        async def worker(i: int) -> None:
            nonlocal done
            while time.monotonic() < end:
                tenant = self.tenants[i % len(self.tenants)]
                rec = Record("capacity", tenant.name, self.clock())
                await self.stream(rec, "/v1/chat/completions", tenant, self.body(tenant, "chat"))
                done += rec.status == "200"

        start = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.monotonic() - start
        taken = [r for r in self.records if r.kind == "capacity"]
        self.records = [r for r in self.records if r.kind != "capacity"]
        return done / elapsed, taken

    async def open_loop(self, rate: float, duration_s: float) -> set[asyncio.Task]:
        """Poisson arrivals at `rate` per second until `duration_s` on `clock`, each a kind drawn by
        its share and a tenant drawn evenly. Returns the requests still in flight."""
        kinds = self.kinds()
        names, weights = list(kinds), list(kinds.values())
        tasks: set[asyncio.Task] = set()
        t = self.clock()
        while True:
            t += self.rng.expovariate(rate)
            if t >= duration_s:
                return tasks
            await asyncio.sleep(max(0.0, t - self.clock()))
            kind, tenant = self.rng.choices(names, weights)[0], self.rng.choice(self.tenants)
            task = asyncio.create_task(self.op(kind, tenant))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            self.sent += 1

    # -- checks ----------------------------------------------------------------------------------
    async def get_status(self, tenant: Tenant, chunk_id: str) -> str:
        try:
            r = await self.client.get(f"/v1/chunks/{chunk_id}", headers=tenant.headers)
            return str(r.status_code)
        except httpx.HTTPError as exc:
            return status_of(exc)

    async def read_status(self, tenant: Tenant, chunk_id: str) -> str:
        """Its data read through (checksums verified): a completion on the chunk alone."""
        body = {**self.body(tenant, "chat", [{"id": chunk_id}]), "stream": False, "max_tokens": 1}
        try:
            r = await self.client.post("/v1/chat/completions", json=body, headers=tenant.headers)
            return str(r.status_code)
        except httpx.HTTPError as exc:
            return status_of(exc)
