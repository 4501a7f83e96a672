"""The serving front: what the HTTP server (and any Python caller) talks to.

In: `CompletionSpec`s (documents as texts or ids of stored chunks, a question, an SLO) and chunk
management calls. Out: `Future[RequestResult]`s, with tokens streamed to an optional callback, and
`ChunkRecord`s. Owns the pipeline, the live engine behind its `EngineLoop`, and the pins that keep
a chunk an in-flight request needs from being deleted under it. A request holds a place in the
loop's queue (`reserve`) from its acceptance, before any costly work for it, so a burst past
`max_queue` is refused at once; its arrival time is taken then too, so tokenizing its documents and
storing their chunk KV (prefilled on a miss) count in its TTFT, as they would for a client.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

from cachesmith.clock import LiveClock
from cachesmith.engine import MAX_AWAITING_VERDICTS, Engine
from cachesmith.engine_loop import EngineClosed, EngineLoop, QueueFull, Slot
from cachesmith.errors import InputError
from cachesmith.kvstore import ChunkStore
from cachesmith.kvstore.keys import dtype_name, validate_key
from cachesmith.pipeline import RagPipeline
from cachesmith.planner import Profile
from cachesmith.profiler.packaged import serving_profile
from cachesmith.request import RequestResult
from cachesmith.server.jobs import BackgroundJobs
from cachesmith.server.specs import ChunkInUse, ChunkRecord, CompletionSpec, ServiceConfig, UnknownChunk
from cachesmith.server.streaming import answer_text
from cachesmith.server.turns import conversation_key, turn_prefixes
from cachesmith.instance import WorkloadInstance

log = logging.getLogger(__name__)
MAX_PENDING_TURN_STORES = 64  # chat exchanges waiting to be stored; past it a turn is answered unstored


class Service:
    def __init__(self, config: ServiceConfig | None = None, pipeline: RagPipeline | None = None,
                 profile: Profile | None = None) -> None:
        self.config = config = config or ServiceConfig()
        self.pipeline = pipeline or RagPipeline(config.model, config.device, config.dtype,
                                                store=ChunkStore(config.store))
        self.profile_source = "given"
        if profile is None:
            profile, self.profile_source = serving_profile(self.pipeline, config.profile_path)
        self.engine = Engine(self.pipeline, profile, config.engine, LiveClock())
        self.loop = EngineLoop(self.engine, config.max_queue, config.is_decode_overlapped)
        self.started_at = time.time()
        self.num_rejected: Counter = Counter()  # "queue_full", "closed", "invalid"
        self.listeners: list[Callable[[RequestResult], None]] = []  # hear every finished request
        self._pins: Counter = Counter()
        self._pin_lock = threading.Lock()
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

    def submit(self, spec: CompletionSpec, on_token: Callable[[int, int], None] | None = None,
               slot: Slot | None = None) -> Future:
        """Queue one request, in `slot` (default: one reserved now; given back here whatever
        happens). Raises `InputError` (bad spec), `QueueFull` or `EngineClosed`; an error found
        while admitting (unknown chunk, context too long) resolves the future at once."""
        slot = slot or self.reserve()
        pinned: list[str] = []
        try:
            max_tokens, slo_s = self._limits(spec)
            keys, fresh = self._store_chunks(spec.documents, self._tokenize(spec, max_tokens), pinned)
            num_prefix_stored = self._ensure_prefix(spec, pinned)
            instance = WorkloadInstance(spec.task, (), spec.question, spec.gold, prefix=spec.system,
                                        answer_prefix=spec.answer_prefix, max_new_tokens=max_tokens,
                                        chunk_ids=tuple(keys), history=spec.history)
            future = self.loop.submit(instance, slo_s, on_token, sampling=spec.sampling, slot=slot)
        except BaseException as exc:
            self._unpin(pinned)
            if isinstance(exc, (QueueFull, EngineClosed, InputError)):
                self.num_rejected[_reason(exc)] += 1
            raise
        finally:
            slot.release()  # a no-op once the loop queued the request
        future.add_done_callback(lambda f: self._finished(f, spec, pinned, num_prefix_stored, fresh))
        return future

    def name_completion(self, completion_id: str, future: Future) -> None:
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

    def cancel(self, future: Future) -> bool:
        """Drop a submitted request that is still queued (its client went away); False if it is
        already running (it then finishes and its answer is discarded)."""
        return self.loop.cancel(future.request_id)

    def _limits(self, spec: CompletionSpec) -> tuple[int, float]:
        cfg = self.config
        if len(spec.documents) > cfg.max_documents:
            raise InputError(f"documents: {len(spec.documents)} documents exceed the limit of {cfg.max_documents}")
        # a chat turn of documents alone asks about them (the chat template still closes the turn)
        if not isinstance(spec.question, str) or not (spec.question.strip() or spec.documents):
            raise InputError("question: must be a non-empty string")
        max_tokens = cfg.default_max_tokens if spec.max_tokens is None else spec.max_tokens
        if not 1 <= max_tokens <= cfg.max_tokens_limit:
            raise InputError(f"max_tokens={max_tokens}: must be between 1 and {cfg.max_tokens_limit}")
        slo_s = cfg.default_slo_s if spec.slo_s is None else spec.slo_s
        if not (math.isfinite(slo_s) and 0 < slo_s <= cfg.max_slo_s):
            raise InputError(f"slo_ms={slo_s * 1e3:g}: must be positive and at most {cfg.max_slo_s * 1e3:g}")
        return max_tokens, slo_s

    def _tokenize(self, spec: CompletionSpec, max_tokens: int) -> list[list[int] | None]:
        """Token ids of text documents (None for stored ones), checked with the whole prompt and
        `max_tokens` against the model's positions before any chunk is prefilled."""
        out: list[list[int] | None] = []
        total = 0
        for i, doc in enumerate(spec.documents):
            if (doc.text is None) == (doc.chunk_id is None):
                raise InputError(f"documents[{i}]: give a text or a chunk id, exactly one")
            if doc.chunk_id is not None:
                validate_key(doc.chunk_id, field=f"documents[{i}].id")
                described = self.store.describe(doc.chunk_id)
                total += len(described[0].token_ids) if described else 0
                out.append(None)
                continue
            if not doc.text.strip():
                raise InputError(f"documents[{i}]: text must not be empty")
            ids = self.pipeline.tokenizer.chunk_ids(doc.text, field=f"documents[{i}]")
            total += len(ids)
            out.append(ids)
        limit = self.pipeline.model.config.max_positions
        num_prefix, num_suffix = self.pipeline.tokenizer.frame_lengths(
            spec.question, spec.system or self.pipeline.system, spec.answer_prefix, spec.history)
        if num_prefix + total + num_suffix + max_tokens > limit:
            # the documents are at fault only where the rest of the prompt fits without them
            is_rest_long = num_prefix + num_suffix + max_tokens > limit
            field = "documents" if spec.documents and not is_rest_long else spec.text_field
            raise InputError(f"{field}: the prompt's {num_prefix + total + num_suffix} tokens + max_tokens "
                             f"{max_tokens} exceed the model's {limit} positions")
        return out

    def _store_chunks(self, documents, token_ids, pinned: list[str]) -> tuple[list[str], list[bool]]:
        """Each document's chunk key, and whether its KV was prefilled now (for this request)."""
        keys, fresh = [], []
        for i, (doc, ids) in enumerate(zip(documents, token_ids)):
            is_new = False
            if ids is None:
                key = doc.chunk_id
                self._pin([key], pinned)
                if not self.store.contains(key):
                    raise UnknownChunk(f"documents[{i}].id={key!r}: unknown chunk id (not in the store; "
                                     f"add it with POST /v1/chunks)")
            else:
                key = self.store.key_for(self.pipeline.model, ids)
                self._pin([key], pinned)  # before storing: a delete cannot slip in between
                with self.loop.admission():
                    _, is_new = self.store.ensure(self.pipeline.model, ids)
            keys.append(key)
            fresh.append(is_new)
        return keys, fresh

    def _ensure_prefix(self, spec: CompletionSpec, pinned: list[str]) -> int:
        """Store the prompt prefix's KV (system, earlier turns, the last user turn's opening) and pin
        it; returns how many of its tokens were stored before this request. A conversation's next
        turn extends the stored earlier turns instead of prefilling them again."""
        system = spec.system or self.pipeline.system
        if spec.history:  # the previous turn's exchange may still be waiting to be stored: now, here
            self._turn_stores.take_over(conversation_key(system, spec.history))
        # within the window (`_tokenize`); rendered and tokenized outside the admission lock
        ids, earlier = turn_prefixes(self.pipeline.tokenizer, system, spec.history)
        self._pin([self.store.key_for(self.pipeline.model, ids)], pinned)
        with self.loop.admission():
            return self.pipeline.ensure_prefix(ids, earlier)[1]

    def _finished(self, future: Future, spec: CompletionSpec, pinned: list[str], num_prefix_stored: int,
                  fresh: list[bool]) -> None:
        self._unpin(pinned)
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
            if not self._turn_stores.submit(conversation_key(system, turns), self._store_turn, system, turns):
                self._dropped_turn_store()
        for listener in self.listeners:
            try:
                listener(result)
            except Exception:  # metrics must never fail a request
                log.exception("result listener failed")

    def _store_turn(self, system: str | None, turns: tuple[tuple[str, str], ...]) -> None:
        """Store a finished exchange's conversation KV for its next turn (off the request's path)."""
        ids, earlier = turn_prefixes(self.pipeline.tokenizer, system, turns, is_head=False)
        if len(ids) >= self.pipeline.model.config.max_positions:
            return  # no next turn fits anyway
        with self.loop.admission():
            self.pipeline.ensure_prefix(ids, earlier)

    def _dropped_turn_store(self) -> None:
        with self._drop_lock:
            self.num_turn_stores_dropped += 1
            is_first = self.num_turn_stores_dropped == 1
        if is_first:  # once: a full queue would otherwise log every turn
            log.warning("%d chat exchanges are waiting to be stored: a turn was answered without storing it "
                        "(its next turn computes it again); further drops are only counted "
                        "(cachesmith:turn_stores_dropped_total)", MAX_PENDING_TURN_STORES)

    def _pin(self, keys: list[str], pinned: list[str]) -> None:
        with self._pin_lock:
            for key in keys:
                self._pins[key] += 1
                pinned.append(key)

    def _unpin(self, keys: list[str]) -> None:
        with self._pin_lock:
            for key in keys:
                self._pins[key] -= 1
                if self._pins[key] <= 0:
                    del self._pins[key]

    # -- chunks --------------------------------------------------------------------------------
    def add_chunks(self, texts: Sequence[str], slot: Slot | None = None) -> list[ChunkRecord]:
        """Store the KV of each text as a chunk (prefilled now unless already stored). An upload
        holds a place in the queue, as a request does (`slot`, default: one reserved now)."""
        slot = slot or self.reserve()
        try:
            ids = []
            for i, text in enumerate(texts):
                if not isinstance(text, str) or not text.strip():
                    raise InputError(f"documents[{i}]: must be a non-empty string")
                ids.append(self.pipeline.tokenizer.chunk_ids(text, field=f"documents[{i}]"))
                self.pipeline.model.as_token_tensor(ids[-1], field=f"documents[{i}]")  # positions limit
            records = []
            for token_ids in ids:
                with self.loop.admission():
                    key, is_new = self.store.ensure(self.pipeline.model, token_ids)
                records.append(replace(self.chunk(key), is_new=is_new))
            return records
        finally:
            slot.release()

    def chunk(self, chunk_id: str) -> ChunkRecord | None:
        """The stored chunk of this model under `chunk_id`, or None."""
        validate_key(chunk_id, field="chunk id")
        described = self.store.describe(chunk_id)
        if described is None:
            return None
        header, tiers = described
        model = self.pipeline.model
        if (header.model_fingerprint, header.dtype) != (model.fingerprint, dtype_name(model.dtype)):
            return None  # another model's entry: not this server's to show
        return ChunkRecord(chunk_id, header.num_tokens, tiers, self.pipeline.tokenizer.decode(header.token_ids))

    def list_chunks(self, limit: int = 100, after: str | None = None) -> tuple[list[ChunkRecord], bool]:
        """This model's stored chunks in id order after `after`; (records, whether more follow)."""
        if not 1 <= limit <= 1000:
            raise InputError(f"limit={limit}: must be between 1 and 1000")
        if after is not None:
            validate_key(after, field="after")
        records = []
        for key in self.store.keys():
            if after is not None and key <= after:
                continue
            record = self.chunk(key)
            if record is None:
                continue
            if len(records) == limit:
                return records, True
            records.append(record)
        return records, False

    def delete_chunk(self, chunk_id: str) -> bool:
        """Delete a chunk from every tier; False if this model has no such chunk."""
        if self.chunk(chunk_id) is None:
            return False
        with self._pin_lock:
            if self._pins[chunk_id] > 0:
                raise ChunkInUse(f"chunk {chunk_id}: in use by {self._pins[chunk_id]} in-flight request(s); "
                                 f"delete it when they are done")
            self.store.delete(chunk_id)
        return True

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
    return "queue_full" if isinstance(exc, QueueFull) else "closed" if isinstance(exc, EngineClosed) else "invalid"
