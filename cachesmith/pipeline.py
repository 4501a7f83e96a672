"""The Python API for one RAG answer: precompute passages, then answer under a given recompute plan.

In: document texts and a question, and the plan to run. Out: `Answer` with the text, TTFT and what
was recomputed; or, for the serving engine, a `Request` whose prompt is keyed and stored here
(`request`, `stored_prompt`). Chunk KV lives in the tiered `ChunkStore` (memory + disk by default); answering
stages it through the transfer engine while the runner computes. The pipeline plans nothing: the
plan the system's own planner chooses for a request under a TTFT SLO comes from `cachesmith.plan_one`
(`OnePlanner.answer`), which sits above the planner and the profiler, themselves above this module.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from cachesmith.errors import InputError
from cachesmith.kvstore import ChunkStore, StoredEntry, StoredPrompt, StoreConfig, TransferConfig, TransferEngine
from cachesmith.model import device as accel
from cachesmith.model import ChunkKV, Decoder, Tokenizer, greedy_decode, resolve_model
from cachesmith.model.chunk import extend_chunk
from cachesmith.model.sampling import GREEDY, SamplingParams
from cachesmith.model.tokenizer import PromptParts
from cachesmith.recompute import BatchRunner, RecomputeConfig
from cachesmith.request import Request, check_fits, check_max_tokens, check_slo
from cachesmith.scoring import Expected


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: list[int]
    ttft_s: float  # prefill (including selection) up to the first token; chunk KV was precomputed
    num_context_tokens: int
    num_suffix_tokens: int
    num_recomputed: int
    plan: str
    qci_entropy: float | None = None  # normalized entropy of layer-0 QCI scores (plans with w >= 1)
    planned_s: float | None = None  # the planner's predicted TTFT of its plan (`plan_one`; None: plan given)


class RagPipeline:
    def __init__(self, model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32",
                 system: str | None = None, store: ChunkStore | None = None,
                 transfer: TransferConfig | None = None) -> None:
        path = resolve_model(model)
        self.model = Decoder(path, device, dtype)
        self.tokenizer = Tokenizer(path)
        self.runner = BatchRunner(self.model)
        self.system = system
        self.store = store or ChunkStore(StoreConfig())
        self.transfer = TransferEngine(self.store, self.model, transfer)
        # wraps each timed prefill (its wait is off the batch's clock): a benchmark on a shared
        # machine waits there for other jobs to pause and notes whether one joined
        # (`calibration.quiet.QuietRun`); None: nothing
        self.batch_guard: Callable[[], AbstractContextManager] | None = None

    def prompt(self, documents: Sequence[str], question: str, answer_prefix: str = "",
               system: str | None = None, history: Sequence[tuple[str, str]] = ()) -> PromptParts:
        return self.tokenizer.rag_prompt_parts(documents, question, system=system or self.system,
                                               answer_prefix=answer_prefix, history=history)

    def ensure_prefix(self, token_ids: Sequence[int], earlier: Sequence[Sequence[int]] = (),
                      namespace: str = "", key: str | None = None) -> tuple[str, int]:
        """Key of the stored KV of a prompt prefix (in `namespace`), and how many of its tokens
        were already stored. On a miss the longest stored `earlier` prefix of it (a conversation's
        earlier turns) is extended by the rest, exactly (both start at position 0), instead of
        prefilling it all."""
        ids = list(token_ids)
        key = key or self.store.key_for(self.model, ids, namespace)  # `key`: the caller's, of the same
        if self.store.contains(key):
            return key, len(ids)
        for base_ids in sorted(earlier, key=len, reverse=True):
            base_ids = list(base_ids)
            if not 0 < len(base_ids) < len(ids) or ids[:len(base_ids)] != base_ids:
                continue  # not a token prefix of this one (the template may differ at the seam)
            base = self.store.get(self.store.key_for(self.model, base_ids, namespace), self.model)
            if base is not None:
                self.store.put(extend_chunk(self.model, base, ids[len(base_ids):]), namespace, key)
                return key, len(base_ids)
        # found missing above: prefilled without opening it (staging opens it, once)
        return self.store.ensure_held(self.model, ids, namespace, key)[0], 0

    def chunk(self, token_ids: Sequence[int]) -> ChunkKV:
        """The stored KV of one chunk (computed and stored on a miss)."""
        key, _ = self.store.ensure(self.model, token_ids)
        return self.store.get(key, self.model)

    def precompute(self, documents: Sequence[str], question: str = "?",
                   system: str | None = None) -> tuple[int, float]:
        """Store the KV of every document and the prompt prefix. Returns (new tokens, seconds)."""
        parts = self.prompt(documents, question, system=system)
        start, num_tokens = time.perf_counter(), 0
        for ids in [parts.prefix_ids, *parts.chunk_ids]:
            if ids and self.store.ensure(self.model, ids)[1]:
                num_tokens += len(ids)
        return num_tokens, time.perf_counter() - start

    def stored_prompt(self, parts: PromptParts, namespace: str = "") -> StoredPrompt:
        """The prompt's entries keyed once in `namespace` and stored (a miss is prefilled here): what
        a `Request` carries to the engine."""
        def entry(ids: Sequence[int]) -> StoredEntry:
            key, is_new = self.store.ensure_held(self.model, ids, namespace)
            return StoredEntry(key, len(ids), tuple(ids), namespace, not is_new)

        chunks = tuple(entry(ids) for ids in parts.chunk_ids)
        prefix = entry(parts.prefix_ids) if parts.prefix_ids else None
        return StoredPrompt(chunks, tuple(parts.suffix_ids), prefix)

    def request(self, request_id: int, documents: Sequence[str], question: str, slo_s: float, *,
                arrival_s: float = 0.0, max_new_tokens: int = 32, system: str = "", answer_prefix: str = "",
                sampling: SamplingParams = GREEDY, expected: Expected = Expected()) -> Request:
        """An engine `Request` of the user's own texts: every document's chunk KV stored (prefilled
        on a miss) here, before it is queued; `system` is the instruction before the documents (""
        keeps the model's default); `expected` names the task and gold to gate against (default:
        none, so not gated)."""
        if isinstance(documents, str) or not all(isinstance(d, str) and d.strip() for d in documents):
            raise InputError(f"request {request_id}: documents must be a sequence of non-empty texts")
        if not question.strip():
            raise InputError(f"request {request_id}: question must be non-empty")
        check_slo(slo_s, f"request {request_id}: slo_s")
        check_max_tokens(max_new_tokens, f"request {request_id}: max_new_tokens")
        parts = self.prompt(documents, question, answer_prefix, system or None)
        check_fits(len(parts.token_ids), max_new_tokens, self.model.config.max_positions, f"request {request_id}")
        return Request(request_id, self.stored_prompt(parts), slo_s, max_new_tokens, arrival_s, sampling, expected)

    def answer(self, documents: Sequence[str], question: str, plan: RecomputeConfig, max_new_tokens: int = 32,
               answer_prefix: str = "", system: str | None = None) -> Answer:
        """Answer from stored chunk KV under `plan`; TTFT covers staging, transfer waits and the
        recompute. A planned answer: `plan_one.OnePlanner.answer`."""
        if plan is None:  # the planned answer moved up: say where, rather than fail deep in the runner
            raise InputError("plan=None: the pipeline runs a given plan; for the planner's plan use "
                             "cachesmith.plan_one.OnePlanner.for_pipeline(pipe).answer(pipe, documents, question)")
        return self.answer_parts(self.prompt(documents, question, answer_prefix, system), plan, max_new_tokens)

    def answer_parts(self, parts: PromptParts, plan: RecomputeConfig, max_new_tokens: int = 32) -> Answer:
        prompt = self.stored_prompt(parts)  # misses are prefilled here, off the clock
        accel.synchronize(self.model.device)
        with self.batch_guard() if self.batch_guard is not None else nullcontext():
            start = time.perf_counter()
            with self.transfer.stage([prompt], plan, [max_new_tokens]) as batch:
                out = self.runner.run(batch.requests, plan, batch)[0]
                out.first_token  # reading the argmax synchronizes with the device
                ttft = time.perf_counter() - start
        ids = greedy_decode(self.model, out.logits, out.cache, max_new_tokens)
        out.cache.release()
        return Answer(self.tokenizer.decode(ids).strip(), ids, ttft, out.num_context, out.num_suffix,
                      int(out.selected.numel()), plan.label(), out.qci_entropy)
