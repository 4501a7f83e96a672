"""`cachesmith precompute`: store the KV of every passage of a corpus file, resumably.

In: a JSONL file, one passage per line (a JSON string, or an object with a "text" field).
Out: entries in the store (skipping those already there) and a `PrecomputeReport`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from cachesmith.errors import InputError
from cachesmith.kvstore.store import ChunkStore
from cachesmith.model import Decoder, Tokenizer


@dataclass(frozen=True)
class PrecomputeReport:
    num_passages: int
    num_computed: int
    num_skipped: int
    num_tokens: int  # tokens computed this run
    seconds: float
    bytes_written: int
    keys: tuple[str, ...] = ()  # each passage's chunk id (store key), in corpus order

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def read_passages(path: Path) -> list[str]:
    """Every passage of a JSONL corpus; a bad line is named by its number."""
    try:
        lines = Path(path).read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 ({exc})") from exc
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc})") from exc
    passages = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{path}:{number}: needs a non-empty string or an object with a 'text' string")
        passages.append(text)
    if not passages:
        raise InputError(f"{path}: holds no passage")
    return passages


def precompute_corpus(path: Path, model: Decoder, tokenizer: Tokenizer, store: ChunkStore,
                      show_progress: bool = True) -> PrecomputeReport:
    passages = read_passages(path)
    written_before = store.stats.bytes_written
    computed = tokens = 0
    keys = []
    start = time.perf_counter()
    bar = tqdm(passages, desc="precompute", unit="passage", disable=not show_progress)
    for i, text in enumerate(bar):
        ids = tokenizer.chunk_ids(text, field=f"{path}:{i + 1}")
        model.as_token_tensor(ids, field=f"{path} passage {i + 1}")
        key, was_computed = store.ensure(model, ids)
        keys.append(key)
        if was_computed:
            computed += 1
            tokens += len(ids)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    return PrecomputeReport(len(passages), computed, len(passages) - computed, tokens,
                            time.perf_counter() - start, store.stats.bytes_written - written_before, tuple(keys))
