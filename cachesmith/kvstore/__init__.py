"""Chunk KV store (memory, disk and redis tiers) and the bandwidth-capped transfer engine."""
from cachesmith.kvstore.entry_format import CorruptEntry
from cachesmith.kvstore.keys import chunk_key, validate_key
from cachesmith.kvstore.link import Link
from cachesmith.kvstore.prompt import StoredEntry, StoredPrompt, put_prompt
from cachesmith.kvstore.store import ChunkStore, StoreConfig, StoreStats, StoreWriteFailed
from cachesmith.kvstore.transfer import (BatchTransfer, TransferConfig, TransferEngine,
                                         TransferStats, layer_needs)

__all__ = ["BatchTransfer", "ChunkStore", "CorruptEntry", "Link", "StoreConfig", "StoreWriteFailed", "StoreStats",
           "StoredEntry", "StoredPrompt", "TransferConfig", "TransferEngine", "TransferStats", "chunk_key", "layer_needs",
           "put_prompt", "validate_key"]
