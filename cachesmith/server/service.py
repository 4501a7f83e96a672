"""The serving front: what the HTTP server (and any Python caller) talks to.

In: `CompletionSpec`s (documents as texts or ids of stored chunks, a question, an SLO) and chunk
management calls. Out: `RequestFuture`s (resolving to `RequestResult`s), with tokens streamed to
an optional callback, and `ChunkRecord`s. Here a spec becomes the engine's one `Request`: its SLO
and `max_tokens` checked against the server's limits and its prompt against the model's positions
(once each, naming the client's fields, before any costly work), then its prompt tokenized once,
each entry keyed once and stored, and the whole `Request` handed to the `EngineLoop`. A request's
chunks are pinned in the chunk catalog (`chunks.ChunkCatalog`) while it is in flight, so none is
deleted under it. A request holds a place in the loop's queue (`reserve`) from its acceptance, so
a burst past `max_queue` is refused at once; its arrival time is taken then too, so tokenizing its
documents and storing their chunk KV (prefilled on a miss) count in its TTFT, as they would for a
client. At start the scheduler's KV capacity, the model's slab pool and the store's memory tier are
sized to the memory available (`memory_budget`; `Service.memory`), or the service is refused.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

from cachesmith.clock import LiveClock
from cachesmith.engine import MAX_AWAITING_VERDICTS, Engine
from cachesmith.engine_loop import EngineLoop
from cachesmith.queue_places import EngineClosed, QueueFull, RequestFuture, Slot
from cachesmith.errors import InputError
from cachesmith.kvstore import ChunkStore, StoredEntry, StoredPrompt
from cachesmith.kvstore.keys import validate_key
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import Profile
from cachesmith.calibration.packaged import serving_profile
from cachesmith.calibration.shadow import shadow_calibrator
from cachesmith.calibration.chunk_prefill import time_chunk_prefills
from cachesmith.request import RequestResult, check_max_tokens, check_slo
from cachesmith.scheduler import QueuedRequest
from cachesmith.scoring import Expected
from cachesmith.shedding import SloUnattainable
from cachesmith.server.chunks import ChunkCatalog, NewEntry
from cachesmith.server.prompt_frame import PromptFrame, prompt_size, tokenize_frame
from cachesmith.server.jobs import BackgroundJobs
from cachesmith.server.memory_budget import MemoryReader, read_available, service_budget, sized_store
from cachesmith.server.specs import ChunkRecord, CompletionSpec, ServiceConfig
from cachesmith.server.tenancy import Caller, Namespaces, StoreQuotaExceeded
from cachesmith.server.streaming import answer_text
from cachesmith.server.turns import conversation_key, turn_prefixes

log = logging.getLogger(__name__)


MAX_PENDING_TURN_STORES = 64  # chat exchanges waiting to be stored; past it a turn is answered unstored


class Service:
    def __init__(self, config: ServiceConfig | None = None, pipeline: RagPipeline | None = None,
                 profile: Profile | None = None, read_memory: MemoryReader = read_available) -> None:
        self.config = config = config or ServiceConfig()
        # sized before the weights load, so a configuration that cannot fit is refused at once
        self.memory = service_budget(config.memory_sizes, config.model, config.device, config.dtype, pipeline,
                                     read_memory)
        self.pipeline = pipeline or RagPipeline(config.model, config.device, config.dtype,
                                                store=ChunkStore(sized_store(config.store, self.memory)))
        self.pipeline.model.kv_pool.max_bytes = self.memory.pool_bytes
        self.pipeline.model.max_graph_bytes = self.memory.graph_bytes
        self.pipeline.model.is_decode_graphed = self.pipeline.model.is_prefill_graphed = config.is_graphed
        self.profile_source = "given"
        if profile is None:
            profile, self.profile_source = serving_profile(self.pipeline, config.profile_path)
        # a learning method calibrates in idle time: the serving front hands the engine that work
        scheduler = replace(config.engine.scheduler, kv_capacity_tokens=self.memory.kv_capacity_tokens)
        engine_config = replace(config.engine, scheduler=scheduler,
                                shadow_work=config.engine.shadow_work or shadow_calibrator)
        self.engine = Engine(self.pipeline, profile, engine_config, LiveClock())
        self.loop = EngineLoop(self.engine, config.max_queue, config.is_decode_overlapped,
                               shedding=config.shedding)
        if config.shedding.is_on:  # new documents priced at the serving machine's pace from the first request
            for num_tokens, seconds in time_chunk_prefills(self.pipeline.model):
                self.loop.deadlines.pricer.observe_prefill(num_tokens, seconds)
        self.started_at = time.time()
        self.num_rejected: Counter = Counter()  # "queue_full", "closed", "invalid", "slo_unattainable"
        self.listeners: list[Callable[[RequestResult], None]] = []  # hear every finished request
        self.chunks = ChunkCatalog(self.pipeline, config, self.loop.admission)
        self._turn_stores = BackgroundJobs("cachesmith-turns", MAX_PENDING_TURN_STORES)
        self.num_turn_stores_dropped = 0  # finished chat turns not stored: the job queue was full
        self._drop_lock = threading.Lock()
        self._completions: OrderedDict[str, int] = OrderedDict()  # completion id -> request id, the latest
        self._completions_lock = threading.Lock()
        self.num_feedback: Counter = Counter()  # verdicts clients sent, by "passed" / "failed"

    @property
    def store(self) -> ChunkStore:
        return self.pipeline.store

    # -- completions ---------------------------------------------------------------------------
    def reserve(self) -> Slot:
        """A place in the queue for a request or chunk upload about to be admitted, before any
        costly work for it (`EngineLoop.reserve`): raises `QueueFull` or `EngineClosed`."""
        try:
            return self.loop.reserve()
        except (QueueFull, EngineClosed) as exc:
            self.num_rejected[_reason(exc)] += 1
            raise

    def check_arrival(self, slot: Slot, spec: CompletionSpec) -> None:
        """Before the request is tokenized (the server calls this on its event loop, before handing
        the request to a worker thread): refuse it (`SloUnattainable`, its place given back) when
        it is not feasible at the shedding margin. A field past its limit (`slo_ms`, `max_tokens`,
        the documents' count) is refused first (`InputError`, a 400 naming it, at any load): a 429
        would have its client retry a request no server can take."""
        try:
            slot.max_tokens, slot.slo_s = self._limits(spec)  # checked here once: `submit` takes them
            self.loop.check_arrival(slot, slot.slo_s, prompt_size(spec))
        except (InputError, SloUnattainable) as exc:
            slot.release()
            self.num_rejected[_reason(exc)] += 1
            raise

    def submit(self, spec: CompletionSpec, on_token: Callable[[int, int], None] | None = None,
               slot: Slot | None = None) -> RequestFuture:
        """Queue one request, in `slot` (default: one reserved now; given back here whatever
        happens). Raises `InputError` (bad spec), `UnknownChunk`, `StoreQuotaExceeded`, `QueueFull`
        or `EngineClosed`; an error found while admitting (context too long) resolves the future
        at once."""
        if slot is None:
            slot = self.reserve()
            self.check_arrival(slot, spec)
        pinned: list[str] = []
        try:
            if slot.slo_s is None:  # a slot reserved without the arrival check
                slot.max_tokens, slot.slo_s = self._limits(spec)
            max_tokens, slo_s = slot.max_tokens, slot.slo_s
            future, prompt, num_prefix_stored = self._queue_prompt(spec, slot, max_tokens, slo_s, on_token, pinned)
        except BaseException as exc:
            self.chunks.unpin(pinned)
            if isinstance(exc, (QueueFull, EngineClosed, InputError, SloUnattainable)):
                self.num_rejected[_reason(exc)] += 1
            raise
        finally:
            slot.release()  # a no-op once the loop queued the request
        fresh = tuple(not stored for stored in prompt.was_stored)
        future.add_done_callback(lambda f: self._finished(f, spec, pinned, num_prefix_stored, fresh))
        return future

    def name_completion(self, completion_id: str, future: RequestFuture) -> None:
        """The id a client sees for a submitted request, so it can send a verdict later."""
        with self._completions_lock:
            self._completions[completion_id] = future.request_id
            while len(self._completions) > MAX_AWAITING_VERDICTS:
                self._completions.popitem(last=False)

    def feedback(self, completion_id: str, passed: bool) -> bool | None:
        """A client's verdict on one of the latest completions: None if the id is not one of them;
        else whether the planner learns from it (a method that learns the served mix, a request
        that ran a plan and had no verdict yet)."""
        with self._completions_lock:
            request_id = self._completions.get(completion_id)
        if request_id is None:
            return None
        self.num_feedback["passed" if passed else "failed"] += 1
        return self.engine.feedback(request_id, passed)

    def cancel(self, future: RequestFuture) -> bool:
        """Drop a submitted request that is still queued (its client went away); False if it is
        already running (it then finishes and its answer is discarded)."""
        return self.loop.cancel(future.request_id)

    def _limits(self, spec: CompletionSpec) -> tuple[int, float]:
        """The request's answer budget and SLO in seconds, every field checked against its limit
        (`InputError` naming it)."""
        cfg = self.config
        if len(spec.documents) > cfg.max_documents:
            raise InputError(f"documents: {len(spec.documents)} documents exceed the limit of {cfg.max_documents}")
        # a chat turn of documents alone asks about them (the chat template still closes the turn)
        if not isinstance(spec.question, str) or not (spec.question.strip() or spec.documents):
            raise InputError("question: must be a non-empty string")
        max_tokens = cfg.default_max_tokens if spec.max_tokens is None else spec.max_tokens
        for field, value in spec.max_tokens_fields or (("max_tokens", max_tokens),):
            check_max_tokens(value, field, cfg.max_tokens_limit)
        return max_tokens, self._slo_s(spec)

    def _slo_s(self, spec: CompletionSpec) -> float:
        """The request's SLO in seconds (the default where it gave none), checked (`InputError`)."""
        cfg = self.config
        slo_s = cfg.default_slo_s if spec.slo_s is None else spec.slo_s
        check_slo(slo_s * 1e3, "slo_ms", cfg.max_slo_s, cfg.min_slo_s, scale=1e3)
        return slo_s

    def _queue_prompt(self, spec: CompletionSpec, slot: Slot, max_tokens: int, slo_s: float, on_token,
                      pinned: list[str]) -> tuple[RequestFuture, StoredPrompt, int]:
        """Tokenize the prompt once, key each entry once in the caller's namespaces, refuse a
        request that cannot be in time or that passes a store cap before writing anything, then,
        in one admission turn, store (and pin) every chunk and the prefix and queue the request.
        Returns its future, its stored prompt and how many prefix tokens were stored before it."""
        spaces = self.chunks.namespaces(spec.caller)
        frame = tokenize_frame(spec, max_tokens, self.pipeline, lambda key, field: self.chunks.check_known(
            key, spaces, field))
        entries = [None if ids is None else self.chunks.entry(ids, spaces.chunks) for ids in frame.document_ids]
        prefix = self.chunks.entry(frame.prefix_ids, spaces.own) if frame.prefix_ids else None
        missing = self.chunks.new_entries([e for e in entries if e is not None])
        self.chunks.check_new_tokens(missing, "documents")  # a cap no retry passes is said first
        self._check_deadline(spec, slot, slo_s, frame, missing, prefix)
        self.chunks.reserve(missing, spaces, "documents")
        if prefix is not None and self.config.tenant_max_bytes is not None:  # the tenant's bytes only
            self.chunks.reserve(self.chunks.new_entries([prefix]), spaces, spec.text_field)
        earlier = self._earlier_turns(spec, spaces) if prefix is not None else []
        # one turn for storing the prompt and joining the queue: a burst's admissions end one after
        # another, in the order they were priced, not all together at its end
        with self.loop.admission():
            keys, fresh = self._store_chunks(spec.documents, frame.document_ids, entries, {e.key for e in missing}, pinned)
            num_prefix_stored = 0
            if prefix is not None:  # system, earlier turns, the last user turn's opening: the caller's own
                self.chunks.pin([prefix.key], pinned)
                num_prefix_stored = self.pipeline.ensure_prefix(frame.prefix_ids, earlier, spaces.own, prefix.key)[1]
            chunks = tuple(StoredEntry(key, n, None if e is None else tuple(ids), "" if e is None else e.namespace, not f)
                           for key, n, ids, e, f in zip(keys, frame.num_document_tokens, frame.document_ids, entries, fresh))
            stored_prefix = None if prefix is None else \
                StoredEntry(prefix.key, len(frame.prefix_ids), tuple(frame.prefix_ids), prefix.namespace)
            prompt = StoredPrompt(chunks, tuple(frame.suffix_ids), stored_prefix)
            request = slot.request(prompt, slo_s, max_tokens, spec.sampling, Expected(spec.task, spec.gold))
            return self.loop.submit(request, on_token, slot), prompt, num_prefix_stored

    def _earlier_turns(self, spec: CompletionSpec, spaces: Namespaces) -> list[list[int]]:
        """A conversation's earlier turns as token prefixes (its stored head extends instead of
        prefilling again), rendered and tokenized before the admission turn. The previous turn's
        exchange may still be waiting to be stored: its job takes a turn, so it is settled first."""
        if not spec.history:
            return []
        system = spec.system or self.pipeline.system
        self._turn_stores.take_over(conversation_key(spaces.own, system, spec.history))
        return turn_prefixes(self.pipeline.tokenizer, system, spec.history)[1]

    def _check_deadline(self, spec: CompletionSpec, slot: Slot, slo_s: float, frame: PromptFrame,
                        missing: list[NewEntry], prefix: NewEntry | None) -> None:
        """Price the request against the work ahead before any of its documents is prefilled (the
        loop refuses it with `SloUnattainable` when it is not feasible at the shedding margin)."""
        counts = sum(frame.num_document_tokens), len(frame.suffix_ids), len(frame.prefix_ids)
        if slot.view is None:  # a slot reserved without the arrival check
            slot.view = QueuedRequest(slot.request_id, slot.arrival_s, slo_s, *counts)
        slot.view.measured(*counts)
        new_tokens = [e.num_tokens for e in missing]
        if prefix is not None and self.chunks.new_entries([prefix]):
            new_tokens.append(prefix.num_tokens)
        text_docs = [(len(d.text), n) for d, n in zip(spec.documents, frame.num_document_tokens) if d.text is not None]
        self.loop.deadlines.pricer.sizes.observe(sum(c for c, _ in text_docs), sum(n for _, n in text_docs),
                                                 sum(e.num_tokens for e in missing))
        self.loop.check_deadline(slot, new_tokens)

    def _store_chunks(self, documents, token_ids, entries: list[NewEntry | None], missing_keys: set[str],
                      pinned: list[str]) -> tuple[list[str], list[bool]]:
        """Caller holds an admission turn. Each document's chunk key, and whether its KV was
        prefilled now (for this request). Only the entries found missing are looked up again (another request may have stored one since);
        one held then and evicted before staging is prefilled there from the request's sources."""
        keys, fresh = [], []
        for doc, ids, entry in zip(documents, token_ids, entries):
            is_new = False
            if entry is None:
                key = doc.chunk_id
                self.chunks.pin([key], pinned)  # known (`tokenize_frame`); a delete since is caught at staging
            else:
                key = entry.key
                self.chunks.pin([key], pinned)  # before storing: a delete cannot slip in between
                if key in missing_keys:  # the caller's admission turn keeps other writers out
                    start = time.perf_counter()
                    _, is_new = self.store.ensure_held(self.pipeline.model, ids, entry.namespace, key)
                    if is_new:  # what new documents cost here, for the next arrivals' estimates
                        self.loop.deadlines.pricer.observe_prefill(len(ids), time.perf_counter() - start)
            keys.append(key)
            fresh.append(is_new)
        return keys, fresh

    def _finished(self, future: RequestFuture, spec: CompletionSpec, pinned: list[str], num_prefix_stored: int,
                  fresh: tuple[bool, ...]) -> None:
        self.chunks.unpin(pinned)
        result = future.result()
        # KV prefilled while admitting this request was computed for it, not served from the store:
        # it does not count as cached (this runs before any reader of the result is called back)
        result.num_cached_prefix = min(result.num_cached_prefix, num_prefix_stored)
        if result.reused_by_chunk:
            result.reused_by_chunk = tuple(0 if f else n for n, f in zip(result.reused_by_chunk, fresh))
        if spec.is_chat and result.error is None and not spec.answer_prefix:
            text, _ = answer_text(result, spec.stop)
            turns = (*spec.history, ("user", spec.question), ("assistant", text))
            system = spec.system or self.pipeline.system
            own = self.chunks.namespaces(spec.caller).own
            if not self._turn_stores.submit(conversation_key(own, system, turns), self._store_turn, own, system,
                                            turns):
                self._dropped_turn_store()
        for listener in self.listeners:
            try:
                listener(result)
            except Exception:  # metrics must never fail a request
                log.exception("result listener failed")

    def _store_turn(self, namespace: str, system: str | None, turns: tuple[tuple[str, str], ...]) -> None:
        """Store a finished exchange's conversation KV for its next turn (off the request's path),
        in its tenant's namespace; past the tenant's byte cap it is not stored (the next turn
        computes it again)."""
        ids, earlier = turn_prefixes(self.pipeline.tokenizer, system, turns, is_head=False)
        if len(ids) >= self.pipeline.model.config.max_positions:
            return  # no next turn fits anyway
        if self.config.tenant_max_bytes is not None:
            spaces = Namespaces(namespace, namespace)
            try:
                self.chunks.reserve(self.chunks.new_entries([self.chunks.entry(ids, namespace)]), spaces, "messages")
            except StoreQuotaExceeded:
                self._dropped_turn_store()
                return
        with self.loop.admission():
            self.pipeline.ensure_prefix(ids, earlier, namespace)

    def _dropped_turn_store(self) -> None:
        with self._drop_lock:
            self.num_turn_stores_dropped += 1
            is_first = self.num_turn_stores_dropped == 1
        if is_first:  # once: a full queue would otherwise log every turn
            log.warning("%d chat exchanges are waiting to be stored: a turn was answered without storing it "
                        "(its next turn computes it again); further drops are only counted "
                        "(cachesmith:turn_stores_dropped_total)", MAX_PENDING_TURN_STORES)

    # -- chunks --------------------------------------------------------------------------------
    def add_chunks(self, texts: Sequence[str], slot: Slot | None = None, caller: Caller = Caller()) -> list[ChunkRecord]:
        """Store the KV of each text as a chunk of the caller (prefilled now unless already stored);
        refused whole (`StoreQuotaExceeded`, nothing stored) past a store cap. An upload holds a
        place in the queue, as a request does (`slot`, default: one reserved now)."""
        slot = slot or self.reserve()
        try:
            spaces = self.chunks.namespaces(caller)
            ids = []
            for i, text in enumerate(texts):
                if not isinstance(text, str) or not text.strip():
                    raise InputError(f"documents[{i}]: must be a non-empty string")
                ids.append(self.pipeline.tokenizer.chunk_ids(text, field=f"documents[{i}]"))
                self.pipeline.model.as_token_tensor(ids[-1], field=f"documents[{i}]")  # positions limit
            entries = [self.chunks.entry(t, spaces.chunks) for t in ids]
            new = self.chunks.new_entries(entries)
            self.chunks.check_new_tokens(new, "documents")
            self.chunks.reserve(new, spaces, "documents")
            records = []
            for token_ids, entry in zip(ids, entries):
                with self.loop.admission():
                    # an upload is named by id alone: acknowledged once a redis failover cannot lose it
                    key, is_new = self.store.ensure(self.pipeline.model, token_ids, entry.namespace, entry.key,
                                                    is_replicated=True)
                records.append(replace(self.chunks.record(key, caller), is_new=is_new))
            return records
        finally:
            slot.release()

    def chunk(self, chunk_id: str, caller: Caller = Caller()) -> ChunkRecord | None:
        """The caller's stored chunk of this model under `chunk_id`, or None (also for an entry
        of another tenant: its existence is not told)."""
        return self.chunks.record(chunk_id, caller)

    def list_chunks(self, limit: int = 100, after: str | None = None,
                    caller: Caller = Caller()) -> tuple[list[ChunkRecord], bool]:
        """The caller's stored chunks of this model in id order after `after`; (records, whether
        more follow)."""
        if not 1 <= limit <= 1000:
            raise InputError(f"limit={limit}: must be between 1 and 1000")
        if after is not None:
            validate_key(after, field="after")
        return self.chunks.list(caller, limit, after)

    def delete_chunk(self, chunk_id: str, caller: Caller = Caller()) -> bool:
        """Delete the caller's chunk from every tier; False if it has no such chunk. Raises
        `ChunkInUse` while a request reads it, `SharedChunk` for a chunk every tenant reads."""
        return self.chunks.delete(chunk_id, caller)

    # -- life cycle ----------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self.loop.queue_depth

    def close(self, timeout: float | None = None) -> bool:
        """Stop taking requests and serve what is queued. True if it drained within `timeout`."""
        drained = self.loop.close(timeout)
        self._turn_stores.close()
        self.store.close()
        return drained


def _reason(exc: Exception) -> str:
    if isinstance(exc, SloUnattainable):
        return "slo_unattainable"
    return "queue_full" if isinstance(exc, QueueFull) else "closed" if isinstance(exc, EngineClosed) else "invalid"
