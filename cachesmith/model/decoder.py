"""Our compact decoder: `embed`, `layers[i]`, `norm`, `head`, plus the reference full prefill.

In: an HF-format model directory (Llama family or Qwen2/Qwen3), a device and a dtype.
Out: a `Decoder` whose pieces the recompute runner drives layer by layer; `prefill` and
`decode_step` here are the exact full-computation reference the identities are checked against.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from cachesmith.errors import InputError
from cachesmith.model import device as accel, native
from cachesmith.model.config import ModelConfig, load_hf_config
from cachesmith.model.kv_cache import KVCache, SlabPool
from cachesmith.model.layers import DecoderLayer, RMSNorm
from cachesmith.model.linear import Linear, send_native, send_one_row_packed, tune_native, tune_one_row
from cachesmith.model.rope import RotaryEmbedding
from cachesmith.model.row_attention import tune_native_attention
from cachesmith.model.identity import model_identity
from cachesmith.model.weights import load_weights

# weights this large do not fit a CPU's caches, so a decode step reads them from memory: only then is
# the one-row kernel worth timing (a tiny model's would be timed from cache, and its load kept fast)
MIN_TUNED_WEIGHT_BYTES = 64 << 20
_ONE_ROW_PACKED: dict[torch.dtype, bool] = {}  # the first load's measurement, per dtype
_NATIVE: dict[torch.dtype, int] = {}  # likewise: the most rows sent to the natively compiled kernel
_NATIVE_ATTENTION: dict[tuple, bool] = {}  # (dtype, heads, KV heads, head size) -> measured faster

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InputError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    """The device by its full name (`cuda` as `cuda:0`: what its tensors report, so comparisons hold)."""
    device = torch.device(device)
    if device.type == "cuda" and not accel.is_cuda_available():
        raise InputError("device='cuda' was asked for but torch sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"device={device.type!r} is not supported; choose 'cpu' or 'cuda'")
    return accel.normalize(device)


class Decoder:
    def __init__(self, model_dir: Path, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "float32") -> None:
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.hf_config = load_hf_config(self.model_dir)
        self.config = ModelConfig.from_hf(self.hf_config)
        weights = load_weights(self.model_dir, self.config, self.device, self.dtype)
        self.fingerprint = model_identity(self.model_dir, self.config, self.hf_config)
        self.embed_weight = weights.embed  # [vocab, hidden]
        self.head_weight = weights.head  # [vocab, hidden]
        self.head_proj = Linear(weights.head)
        self.layers = [DecoderLayer(self.config, w) for w in weights.layers]
        self.norm = RMSNorm(weights.norm, self.config.rms_norm_eps)
        self.rope = RotaryEmbedding(self.hf_config, self.device, self.dtype)
        self.kv_pool = SlabPool()  # released caches' slabs, reused by the next ones
        self.is_native_attention = False  # decode rows attend through `model.native` (see `use_native`)
        self.native_rows = 0  # calls of up to this many rows multiply through `model.native`
        self.native_layer_table: native.LayerTable | None = None  # set where whole decode layers run natively
        # on CUDA, plain-greedy decode steps replay captured CUDA graphs (`model.graph_decode`);
        # False: every step eager (`serve --no-cuda-graphs`). No effect on the CPU.
        self.is_decode_graphed = True
        # on CUDA, recompute runs of graphable plans replay captured CUDA graphs
        # (`recompute.graph_prefill`); False: every run eager (`serve --no-cuda-graphs`)
        self.is_prefill_graphed = True
        # device memory the decode graphs' buckets may hold (`server.memory_budget`); None: what is free
        self.max_graph_bytes: int | None = None
        self._tune_kernels()

    @property
    def is_one_row_packed(self) -> bool:
        """Whether a decode step's one-row matmuls go to the prepacked kernel."""
        return self.head_proj.is_one_row_packed

    @property
    def one_row_kernel(self) -> str:
        """Which kernel a decode step's one-row matmuls go to (`Linear.one_row_kernel`)."""
        return self.head_proj.one_row_kernel

    @property
    def linears(self) -> list[Linear]:
        """Every matrix a decode step multiplies: the LM head, then each layer's."""
        return [self.head_proj] + [lin for layer in self.layers for lin in layer.linears]

    def use_native(self, max_rows: int, is_attention: bool) -> None:
        """Calls of up to `max_rows` rows (0: none) multiply through `model.native`, and decode rows
        attend through it or not. Where every layer's matrices then go native, a decode step of up
        to `max_rows` sequences runs all its layers in one native call (`native_layer_table`)."""
        send_native(self.linears, max_rows)
        self.native_rows, self.is_native_attention = max_rows, is_attention
        is_whole = (max_rows > 0 and is_attention and not self.config.is_qk_norm and native.supports_layers(self.dtype)
                    and all(lin.native is not None for layer in self.layers for lin in layer.linears))
        cfg = self.config
        self.native_layer_table = native.layer_table(
            [(*(lin.native for lin in layer.linears), layer.qkv_bias, layer.input_norm.weight, layer.post_norm.weight)
             for layer in self.layers], hidden=cfg.hidden_size, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate_size,
            eps=cfg.rms_norm_eps) if is_whole else None

    def _tune_kernels(self) -> None:
        """Measure which kernels one decode row goes to (`model.linear.tune_one_row`, then
        `tune_native`, and `model.row_attention.tune_native_attention`), once per process and
        shape: two models loaded by one process then round alike."""
        linears = self.linears
        num_bytes = sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)
        if self.device.type != "cpu" or num_bytes < MIN_TUNED_WEIGHT_BYTES:
            return
        if self.dtype not in _ONE_ROW_PACKED:
            _ONE_ROW_PACKED[self.dtype] = tune_one_row(linears)
        elif _ONE_ROW_PACKED[self.dtype]:
            send_one_row_packed(linears)
        if self.dtype not in _NATIVE:
            _NATIVE[self.dtype] = tune_native(linears)
        cfg = self.config
        key = (self.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        if key not in _NATIVE_ATTENTION:
            _NATIVE_ATTENTION[key] = tune_native_attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        self.use_native(_NATIVE[self.dtype], _NATIVE_ATTENTION[key])

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def weight_tensors(self) -> list[torch.Tensor]:
        """The checkpoint's tensors as loaded (device and dtype of the model; a tied head once),
        without the packed or native copies some kernels keep beside them."""
        out = [self.embed_weight, self.norm.weight]
        if self.head_weight is not self.embed_weight:
            out.append(self.head_weight)
        for layer in self.layers:
            out += [layer.input_norm.weight, layer.post_norm.weight, layer.o_proj.weight,
                    layer.gate_up_proj.weight, layer.down_proj.weight, layer.qkv_weight]
            out += [norm.weight for norm in (layer.q_norm, layer.k_norm) if norm is not None]
            out += [] if layer.qkv_bias is None else [layer.qkv_bias]
        return out

    # -- pieces -------------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [num_tokens] -> hidden [num_tokens, hidden]."""
        return self.embed_weight[token_ids]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden of the selected positions [k, hidden] -> float32 logits [k, vocab]."""
        return self.head_proj(hidden).float()

    # -- validation ---------------------------------------------------------------------------
    def as_token_tensor(self, token_ids: Sequence[int] | torch.Tensor, field: str = "token_ids",
                        start: int = 0) -> torch.Tensor:
        """`checked_token_ids` on the model's device."""
        return self.checked_token_ids(token_ids, field, start).to(self.device)

    def checked_token_ids(self, token_ids: Sequence[int] | torch.Tensor, field: str = "token_ids",
                          start: int = 0) -> torch.Tensor:
        """The ids as a long tensor where they were given, once checked: non-empty, 1-D, within the
        model's positions from `start`, inside the vocabulary (an `InputError` naming `field`)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise InputError(f"{field} must be a non-empty 1-D sequence of token ids")
        if start + ids.numel() > self.config.max_positions:
            raise InputError(
                f"{field}: {start + ids.numel()} positions exceed the model's maximum of "
                f"{self.config.max_positions}")
        # ids given on the host are checked there: a tensor's min and max are values read back
        lo, hi = (int(ids.min()), int(ids.max())) if isinstance(token_ids, torch.Tensor) else \
            (min(token_ids), max(token_ids))
        if lo < 0 or hi >= self.config.vocab_size:
            raise InputError(f"{field} holds ids outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    # -- reference full computation -----------------------------------------------------------
    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, start: int = 0, cache: KVCache | None = None,
                pre_rope_keys: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Full causal pass over contiguous positions [start, start + T) with no other context.

        Writes rotated K/V into `cache` (if given) and appends each layer's pre-RoPE K to
        `pre_rope_keys` (if given). Returns the final-normed hidden [T, hidden].
        """
        cos, sin = self.rope.cos_sin_range(start, start + token_ids.numel())  # known on the host: no read back
        h = self.embed(token_ids)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(layer.input_norm(h))
            if pre_rope_keys is not None:
                pre_rope_keys.append(k)
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
            if cache is not None:  # attend over the cache's contiguous copy: V sliced out of the
                cache.write(i, start, k, v)  # fused QKV output has a wide row stride (slower SDPA)
                k, v = cache.keys[i][start:start + k.shape[0]], cache.values[i][start:start + k.shape[0]]
            h = h + layer.out_proj(layer.attend(q, k, v, is_causal=True))
            h = layer.mlp_block(h)
        if cache is not None:
            cache.num_tokens = start + token_ids.numel()
        return self.norm(h)

    def new_cache(self, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, self.device, self.dtype,
                       self.kv_pool)

    def prefill(self, token_ids: Sequence[int] | torch.Tensor,
                extra_capacity: int = 0) -> tuple[torch.Tensor, KVCache]:
        """Full prefill: float32 logits of the last position [vocab] and the filled cache."""
        ids = self.as_token_tensor(token_ids)
        cache = self.new_cache(ids.numel() + extra_capacity)
        hidden = self.forward(ids, cache=cache)
        return self.head(hidden[-1:])[0], cache

    @torch.inference_mode()
    def extend(self, token_ids: Sequence[int] | torch.Tensor, cache: KVCache,
               pre_rope_keys: list[torch.Tensor] | None = None) -> torch.Tensor:
        """New tokens at positions [cache.num_tokens, + T) over everything the cache holds (causal
        among themselves); their K/V are appended (and each layer's pre-RoPE K to `pre_rope_keys`,
        if given). Returns the final-normed hidden [T, hidden]."""
        start = cache.num_tokens
        if start + len(token_ids) > self.config.max_positions:
            raise InputError(f"decode reached the model's maximum of {self.config.max_positions} positions")
        ids = self.as_token_tensor(token_ids, start=start)
        end = start + ids.numel()
        positions = torch.arange(start, end, device=self.device)
        cos, sin = self.rope.cos_sin_range(start, end)
        # one row sees every key; several need the causal-by-position mask [T, end]
        mask = None if ids.numel() == 1 else torch.arange(end, device=self.device)[None, :] <= positions[:, None]
        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(layer.input_norm(h))
            if pre_rope_keys is not None:
                pre_rope_keys.append(k)
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
            cache.write(i, start, k, v)
            keys, values = cache.view(i, end)
            h = h + layer.out_proj(layer.attend(q, keys, values, mask=mask))
            h = layer.mlp_block(h)
        cache.num_tokens = end
        return self.norm(h)

    def decode_step(self, token_id: int, cache: KVCache) -> torch.Tensor:
        """One token at position cache.num_tokens attending to the whole cache -> logits [vocab]."""
        return self.head(self.extend([token_id], cache))[0]
