"""The Python API for one RAG answer: precompute passages, then answer with any recompute plan.

In: document texts and a question. Out: `Answer` with the text, TTFT and what was recomputed.
Chunk KV is kept in memory per (text) until the KV store takes over; the CLI and demo are thin
layers over this.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cachesmith.model import ChunkKV, Decoder, Tokenizer, greedy_decode, prefill_chunk, resolve_model
from cachesmith.model.tokenizer import PromptParts
from cachesmith.recompute import BatchRunner, RecomputeConfig, RecomputeRequest


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: list[int]
    ttft_s: float  # prefill (including selection) up to the first token; chunk KV was precomputed
    num_context_tokens: int
    num_suffix_tokens: int
    num_recomputed: int
    plan: str


class RagPipeline:
    def __init__(self, model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32",
                 system: str | None = None) -> None:
        path = resolve_model(model)
        self.model = Decoder(path, device, dtype)
        self.tokenizer = Tokenizer(path)
        self.runner = BatchRunner(self.model)
        self.system = system
        self._chunks: dict[tuple[int, ...], ChunkKV] = {}

    def prompt(self, documents: Sequence[str], question: str, answer_prefix: str = "") -> PromptParts:
        return self.tokenizer.rag_prompt_parts(documents, question, system=self.system,
                                               answer_prefix=answer_prefix)

    def chunk(self, token_ids: Sequence[int]) -> ChunkKV:
        key = tuple(token_ids)
        if key not in self._chunks:
            self._chunks[key] = prefill_chunk(self.model, list(token_ids))
        return self._chunks[key]

    def precompute(self, documents: Sequence[str], question: str = "?") -> tuple[int, float]:
        """Compute and keep the KV of every document (and the prompt prefix). Returns (tokens, s)."""
        parts = self.prompt(documents, question)
        start, num_tokens = time.perf_counter(), 0
        for ids in [parts.prefix_ids, *parts.chunk_ids]:
            if ids and tuple(ids) not in self._chunks:
                self.chunk(ids)
                num_tokens += len(ids)
        return num_tokens, time.perf_counter() - start

    def answer(self, documents: Sequence[str], question: str, plan: RecomputeConfig,
               max_new_tokens: int = 32, answer_prefix: str = "") -> Answer:
        parts = self.prompt(documents, question, answer_prefix)
        request = RecomputeRequest(
            chunks=[self.chunk(ids) for ids in parts.chunk_ids],
            suffix_ids=parts.suffix_ids,
            prefix=self.chunk(parts.prefix_ids) if parts.prefix_ids else None,
            extra_capacity=max_new_tokens,
        )
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = self.runner.run([request], plan)[0]
        out.first_token  # reading the argmax synchronizes with the device
        ttft = time.perf_counter() - start
        ids = greedy_decode(self.model, out.logits, out.cache, max_new_tokens)
        return Answer(self.tokenizer.decode(ids).strip(), ids, ttft, out.num_context, out.num_suffix,
                      int(out.selected.numel()), plan.label())
