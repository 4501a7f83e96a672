"""A chunk prefill timed when a server starts, so deadline-aware admission prices new documents at
the serving machine's pace before any document was served.

In: a `Decoder`. Out: (tokens, seconds) of each timed prefill of a synthetic chunk, after one
untimed run (the first call pays one-time costs: allocation, kernel selection). The cost model
prices a chunk from the recompute runner's layer costs; a chunk's plain forward pass runs 1.6-3.7x
slower than that price on the packaged model on 2 cores (100-1000 tokens), so a burst's first
estimates, made before any of its documents finished prefilling, would admit several times too
many requests.
"""
from __future__ import annotations

import time

from cachesmith.model.chunk import prefill_chunk
from cachesmith.model.decoder import Decoder

PROBE_TOKENS = 128  # about a short retrieved passage; the probe costs a few of these at start
NUM_TIMED = 2


def time_chunk_prefills(model: Decoder, num_tokens: int = PROBE_TOKENS, num_timed: int = NUM_TIMED
                        ) -> list[tuple[int, float]]:
    ids = [(7 * i + 11) % model.config.vocab_size for i in range(num_tokens)]  # any ids: the time is the shape's
    prefill_chunk(model, ids)
    out = []
    for _ in range(num_timed):
        start = time.perf_counter()
        prefill_chunk(model, ids)
        out.append((num_tokens, time.perf_counter() - start))
    return out
