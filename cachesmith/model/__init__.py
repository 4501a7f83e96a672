"""Model assets, our layer-by-layer decoder, chunk KV precompute and greedy decoding."""
from cachesmith.model.assets import DEFAULT_MODEL, fetch, resolve_model
from cachesmith.model.chunk import ChunkKV, prefill_chunk
from cachesmith.model.config import ModelConfig
from cachesmith.model.decoder import Decoder
from cachesmith.model.generate import Decoding, Generation, greedy_decode
from cachesmith.model.sampling import GREEDY, SamplingParams, TokenLogprob
from cachesmith.model.kv_cache import KVCache
from cachesmith.model.tokenizer import PromptParts, Tokenizer

__all__ = ["DEFAULT_MODEL", "GREEDY", "ChunkKV", "Decoder", "Decoding", "Generation", "KVCache", "ModelConfig",
           "PromptParts", "SamplingParams", "TokenLogprob", "Tokenizer",
           "fetch", "greedy_decode", "prefill_chunk", "resolve_model"]
