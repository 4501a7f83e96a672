"""cachesmith: RAG prefill serving with cached chunk KV and budgeted selective recomputation."""
__version__ = "0.1.0"
