"""Chunk KV store (memory, disk and redis tiers) and the bandwidth-capped transfer engine."""
from cachesmith.kvstore.entry_format import CorruptEntry
from cachesmith.kvstore.keys import chunk_key, validate_key
from cachesmith.kvstore.link import Link
from cachesmith.kvstore.store import ChunkStore, StoreConfig, StoreStats, StoreWriteFailed
from cachesmith.kvstore.transfer import (BatchTransfer, KeyedRequest, TransferConfig, TransferEngine,
                                         TransferStats, layer_needs)

__all__ = ["BatchTransfer", "ChunkStore", "CorruptEntry", "KeyedRequest", "Link", "StoreConfig", "StoreWriteFailed",
           "StoreStats", "TransferConfig", "TransferEngine", "TransferStats", "chunk_key", "layer_needs",
           "validate_key"]
