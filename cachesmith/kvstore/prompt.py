"""A prompt whose KV is stored: what a request carries from whoever stored it to the transfer engine.

In: the keys of entries already in the store (the prompt prefix's and each chunk's, in prompt
order, each keyed once by its caller in the caller's namespace) and the suffix's token ids, which
are always computed. Out: a `StoredPrompt`, which the engine counts tokens from and the transfer
engine stages as given, never re-deriving a key. Each entry remembers its token ids where the
caller had them, so one evicted from every tier before staging is prefilled there again instead of
failing its batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from cachesmith.kvstore.store import ChunkStore
from cachesmith.model import ChunkKV


class StoredEntry(NamedTuple):
    key: str
    num_tokens: int
    token_ids: tuple[int, ...] | None = None  # what rebuilds it if evicted before staging; None: cannot
    namespace: str = ""  # the store namespace it was keyed in
    was_stored: bool = True  # False: prefilled for this request (its KV was not served from the store)


@dataclass(frozen=True)
class StoredPrompt:
    """[prefix | chunk 1 | ... | chunk K | suffix]: the prefix and chunks stored, the suffix as ids."""
    chunks: tuple[StoredEntry, ...]
    suffix_ids: tuple[int, ...]
    prefix: StoredEntry | None = None

    @property
    def chunk_keys(self) -> tuple[str, ...]:
        return tuple(e.key for e in self.chunks)

    @property
    def chunk_num_tokens(self) -> tuple[int, ...]:
        return tuple(e.num_tokens for e in self.chunks)

    @property
    def prefix_key(self) -> str | None:
        return None if self.prefix is None else self.prefix.key

    @property
    def num_prefix_tokens(self) -> int:
        return 0 if self.prefix is None else self.prefix.num_tokens

    @property
    def num_context_tokens(self) -> int:
        return sum(e.num_tokens for e in self.chunks)

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_context_tokens + len(self.suffix_ids)

    @property
    def was_stored(self) -> tuple[bool, ...]:
        """Per chunk: False where its KV was prefilled for this request."""
        return tuple(e.was_stored for e in self.chunks)

    def entries(self) -> list[tuple[str, StoredEntry]]:
        """(field name, entry) in prompt order: the prefix first, then each chunk."""
        named = [("prefix", self.prefix)] if self.prefix is not None else []
        return named + [(f"chunks[{j}]", e) for j, e in enumerate(self.chunks)]


def put_prompt(store: ChunkStore, chunks: Sequence[ChunkKV], suffix_ids: Sequence[int], prefix: ChunkKV | None = None,
               namespace: str = "") -> StoredPrompt:
    """Store computed chunk KV (and a prefix) in `store` and return the prompt that stages it: what a
    benchmark or test that built its chunks itself hands the transfer engine."""
    def entry(chunk: ChunkKV) -> StoredEntry:
        return StoredEntry(store.put(chunk, namespace), chunk.num_tokens, tuple(chunk.token_ids), namespace)

    return StoredPrompt(tuple(entry(c) for c in chunks), tuple(suffix_ids),
                        None if prefix is None else entry(prefix))
