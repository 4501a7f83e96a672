"""A server's memory budget: the KV capacity, the slab pool and the memory tier sized to the machine.

In: the model's config, dtype and device, the memory available at start (`read_available`, or any
reader a caller injects) and the sizes an operator set (`ExplicitSizes`; None: sized here). Out: a
`MemoryBudget`, or a `ConfigError` naming the flags and the numbers where the configuration cannot
fit, so a server is refused at start instead of killed later by the OS.

The rule (docs/limits.md, "Memory"): what is left = the memory available at start - the model's
weights - the sizes set explicitly. Of it, each size not set gets its fraction, capped at the
fixed default it replaces:

  KV capacity  40%  (at most 65,536 tokens: a full batch of 8 at the packaged model's 8,192 positions)
  slab pool    20%  (at most 4 GiB)
  memory tier  15%  (at most 1 GiB)

  decode graphs 15% (CUDA only: the static slabs of the captured decode steps' buckets, at most
                    the largest bucket, 64 rows x the model's positions)

The other 25% is headroom: activations of a prefill, each decoding sequence's own cache, slabs
rounded up to their capacity, the runtime and the OS (on the CPU, graphs take nothing and their
share is headroom too). The caps keep a large machine serving as it
did with the fixed defaults (the profile's scheduling was measured there). On CUDA the weights, the
KV and the pool are device memory (the device's free memory at start); the memory tier is host RAM.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cachesmith.errors import ConfigError
from cachesmith.kvstore import StoreConfig
from cachesmith.kvstore.store import DEFAULT_MEMORY_BYTES
from cachesmith.kvstore.tiers import MemoryTier
from cachesmith.model import device as accel
from cachesmith.model import resolve_model
from cachesmith.model.config import ModelConfig, load_hf_config
from cachesmith.model.decoder import resolve_device, resolve_dtype
from cachesmith.model.graph_decode import BATCH_BUCKETS
from cachesmith.model.kv_cache import MAX_POOL_BYTES
from cachesmith.pipeline import RagPipeline
from cachesmith.scheduler import SchedulerConfig

KV_FRACTION = 0.40
POOL_FRACTION = 0.20
TIER_FRACTION = 0.15
GRAPH_FRACTION = 0.15
MAX_KV_CAPACITY_TOKENS = SchedulerConfig.kv_capacity_tokens  # the scheduler's fixed default, 65,536
MAX_TIER_BYTES = DEFAULT_MEMORY_BYTES
# a sized KV capacity below this is refused at start: a few retrieved passages would not fit
MIN_KV_CAPACITY_TOKENS = 1024
# on the CPU each weight matrix is also kept packed for oneDNN and in the native kernels' panels
# (`model.linear`): three copies, about 1.6 GB for the packaged model in float32 (docs/models.md)
CPU_WEIGHT_COPIES = 3
MEMINFO = Path("/proc/meminfo")
FLAGS = {"kv_capacity_tokens": "--kv-capacity", "kv_pool_bytes": "--kv-pool-bytes", "memory_bytes": "--memory-bytes"}


@dataclass(frozen=True)
class AvailableMemory:
    """Memory free at start: host RAM, and a CUDA device's free memory (None on the CPU)."""
    host_bytes: int
    device_bytes: int | None = None
    source: str = ""  # where the numbers were read, for the start line

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or (self.device_bytes is not None and self.device_bytes < 0):
            raise ConfigError(f"available memory must be >= 0 (host {self.host_bytes}, device {self.device_bytes})")


MemoryReader = Callable[[torch.device], AvailableMemory]


@dataclass(frozen=True)
class ExplicitSizes:
    """What the operator set (None: sized to the machine). `has_memory_tier`: False where the
    store has no memory tier (it then takes no memory)."""
    kv_capacity_tokens: int | None = None
    kv_pool_bytes: int | None = None
    memory_bytes: int | None = None
    has_memory_tier: bool = True

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ConfigError(f"kv_capacity_tokens={self.kv_capacity_tokens} must be >= 1 (None: sized to the machine)")
        if self.kv_pool_bytes is not None and self.kv_pool_bytes < 0:
            raise ConfigError(f"kv_pool_bytes={self.kv_pool_bytes} must be >= 0 (None: sized to the machine)")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ConfigError(f"memory_bytes={self.memory_bytes} must be >= 1 (None: sized to the machine)")


@dataclass(frozen=True)
class MemoryBudget:
    weights_bytes: int
    kv_capacity_tokens: int
    kv_bytes: int
    pool_bytes: int
    tier_bytes: int  # 0: the store has no memory tier
    available_bytes: int  # where the weights, KV and pool live (host RAM, or the device), before the weights
    source: str
    host_available_bytes: int  # what the memory tier is sized from (host RAM)
    is_cuda: bool = False
    explicit: tuple[str, ...] = ()  # the `ExplicitSizes` fields the operator set
    graph_bytes: int = 0  # the decode graphs' buckets (CUDA only)
    max_graph_bytes: int = 0  # the largest bucket the model could use (the share's cap)

    def describe(self) -> str:
        """One line: each size and how it was chosen (its flag, its fraction, or its cap), then the
        memory it was sized from."""
        where = " on the device" if self.is_cuda else ""
        kv = self._how("kv_capacity_tokens", self.kv_capacity_tokens, MAX_KV_CAPACITY_TOKENS, KV_FRACTION)
        pool = self._how("kv_pool_bytes", self.pool_bytes, MAX_POOL_BYTES, POOL_FRACTION)
        tier = self._how("memory_bytes", self.tier_bytes, MAX_TIER_BYTES, TIER_FRACTION)
        parts = [f"weights {human_bytes(self.weights_bytes)}{where}",
                 f"KV capacity {self.kv_capacity_tokens:,} tokens = {human_bytes(self.kv_bytes)} {kv}",
                 f"slab pool {human_bytes(self.pool_bytes)} {pool}",
                 f"memory tier {human_bytes(self.tier_bytes)} {tier}" if self.tier_bytes else "no memory tier"]
        if self.is_cuda:
            how = "(its cap)" if self.graph_bytes == self.max_graph_bytes else f"({GRAPH_FRACTION:.0%} of what is left)"
            parts.insert(3, f"decode graph buckets {human_bytes(self.graph_bytes)} {how}")
        return ", ".join(parts) + (f"; {human_bytes(self.available_bytes)} available ({self.source}), "
                                   f"{human_bytes(self.headroom_bytes)} left as headroom")

    @property
    def headroom_bytes(self) -> int:
        """What the budget leaves free in the memory the weights, KV and pool share."""
        used = self.weights_bytes + self.kv_bytes + self.pool_bytes + self.graph_bytes + \
            (0 if self.is_cuda else self.tier_bytes)
        return self.available_bytes - used

    def _how(self, name: str, value: int, cap: int, fraction: float) -> str:
        if name in self.explicit:
            return f"({FLAGS[name]})"
        return "(its cap)" if value == cap else f"({fraction:.0%} of what is left)"


def human_bytes(num_bytes: float) -> str:
    """`1.2 GiB`, `340.0 MiB`: powers of 1024, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def num_parameters(config: ModelConfig) -> int:
    """Parameters the decoder loads: embeddings, each layer's matrices, biases and norms, the head."""
    c = config
    embeddings = c.vocab_size * c.hidden_size * (1 if c.is_tied_embeddings else 2)
    return embeddings + c.num_layers * c.num_layer_parameters + c.hidden_size


def weights_bytes(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """The weights' resident bytes on `device`: their copies kept for the CPU kernels included."""
    copies = 1 if accel.is_cuda(device) else CPU_WEIGHT_COPIES
    return copies * num_parameters(config) * _element_bytes(dtype)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * _element_bytes(dtype)


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def parse_meminfo(text: str) -> tuple[int, str]:
    """Bytes available from `/proc/meminfo`'s text: MemAvailable (what the kernel can give without
    swapping), else MemTotal (kernels before 3.14); and which field it was."""
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        value = rest.split()
        if value and value[0].isdigit():
            fields[name.strip()] = int(value[0]) * (1024 if value[1:] == ["kB"] else 1)
    for name in ("MemAvailable", "MemTotal"):
        if name in fields:
            return fields[name], f"/proc/meminfo {name}"
    raise ConfigError("/proc/meminfo gives neither MemAvailable nor MemTotal")


def _host_available() -> tuple[int, str]:
    if MEMINFO.exists():
        return parse_meminfo(MEMINFO.read_text(encoding="ascii", errors="replace"))
    # no /proc (macOS): the machine's total, the best a portable call gives
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "sysconf total RAM"


def read_available(device: torch.device) -> AvailableMemory:
    """The memory free now: host RAM, and on CUDA the device's free memory (`model.device`)."""
    host, source = _host_available()
    if not accel.is_cuda(device):
        return AvailableMemory(host, None, f"host RAM, {source}")
    free, _total = accel.memory_info(device)
    return AvailableMemory(host, free, f"{device} free memory; host RAM, {source}")


def plan_memory(config: ModelConfig, dtype: torch.dtype, device: torch.device, available: AvailableMemory,
                explicit: ExplicitSizes = ExplicitSizes(), is_weights_loaded: bool = False) -> MemoryBudget:
    """The budget by the module's rule. `is_weights_loaded`: `available` was read after the
    weights loaded (a caller's pipeline), so they are added back."""
    is_cuda = accel.is_cuda(device)
    if is_cuda and available.device_bytes is None:
        raise ConfigError(f"device {device}: the memory reader gave no device memory")
    weights = weights_bytes(config, dtype, device)
    per_token = kv_bytes_per_token(config, dtype)
    near = (available.device_bytes if is_cuda else available.host_bytes) + (weights if is_weights_loaded else 0)
    host = near if not is_cuda else available.host_bytes
    set_kv = None if explicit.kv_capacity_tokens is None else explicit.kv_capacity_tokens * per_token
    set_tier = explicit.memory_bytes if explicit.has_memory_tier else 0
    _check_fits(explicit, weights, set_kv, set_tier, near, host, is_cuda, available.source)
    left = near - weights - (set_kv or 0) - (explicit.kv_pool_bytes or 0) - (0 if is_cuda else set_tier or 0)
    host_left = left if not is_cuda else host - (set_tier or 0)
    tokens = explicit.kv_capacity_tokens or _sized_tokens(left, per_token, weights, near, available.source)
    pool = explicit.kv_pool_bytes if explicit.kv_pool_bytes is not None else \
        min(MAX_POOL_BYTES, int(POOL_FRACTION * left))
    tier = set_tier if set_tier is not None else max(1, min(MAX_TIER_BYTES, int(TIER_FRACTION * host_left)))
    named = tuple(name for name in FLAGS if getattr(explicit, name) is not None)
    largest = per_token * BATCH_BUCKETS[-1] * config.max_positions if is_cuda else 0
    graphs = min(largest, max(0, int(GRAPH_FRACTION * left)))
    return MemoryBudget(weights, tokens, tokens * per_token, pool, tier, near, available.source, host, is_cuda, named,
                        graphs, largest)


def _sized_tokens(left: int, per_token: int, weights: int, near: int, source: str) -> int:
    tokens = min(MAX_KV_CAPACITY_TOKENS, int(KV_FRACTION * left) // per_token)
    if tokens < MIN_KV_CAPACITY_TOKENS:
        raise ConfigError(
            f"KV capacity sized to the machine would be {tokens:,} tokens ({KV_FRACTION:.0%} of the "
            f"{human_bytes(left)} left after the weights ({human_bytes(weights)}) and the sizes set, of "
            f"{human_bytes(near)} available ({source})), below {MIN_KV_CAPACITY_TOKENS:,}: free memory, "
            f"or set --kv-capacity (and --kv-pool-bytes, --memory-bytes) explicitly")
    return tokens


def _check_fits(explicit: ExplicitSizes, weights: int, set_kv: int | None, set_tier: int | None, near: int,
                host: int, is_cuda: bool, source: str) -> None:
    """Refuse what cannot fit: the weights and the explicit sizes sharing one memory past what it has."""
    shares = [("the model's weights", weights)]
    if set_kv is not None:
        shares.append((f"--kv-capacity {explicit.kv_capacity_tokens:,} tokens", set_kv))
    if explicit.kv_pool_bytes is not None:
        shares.append(("--kv-pool-bytes", explicit.kv_pool_bytes))
    tier_share = [("--memory-bytes", set_tier)] if explicit.memory_bytes is not None and set_tier else []
    if not is_cuda:
        shares += tier_share
    elif tier_share and set_tier > host:
        raise ConfigError(f"--memory-bytes {human_bytes(set_tier)} does not fit in the host's "
                          f"{human_bytes(host)} available ({source})")
    need = sum(n for _, n in shares)
    if need > near:
        named = " + ".join(f"{what} {human_bytes(n)}" for what, n in shares)
        raise ConfigError(f"memory does not fit: {named} = {human_bytes(need)}, more than the "
                          f"{human_bytes(near)} available ({source}); lower the flags named or free memory")


def service_budget(sizes: ExplicitSizes, model: str, device: str, dtype: str, pipeline: RagPipeline | None,
                   read_memory: MemoryReader) -> MemoryBudget:
    """A server's budget by the rule: from the model's config before its weights load (a
    configuration that cannot fit is refused before they do); for a caller's pipeline, from its
    loaded model, its store's memory tier counting as set."""
    if pipeline is None:
        where = resolve_device(device)
        config = ModelConfig.from_hf(load_hf_config(resolve_model(model)))
        return plan_memory(config, resolve_dtype(dtype), where, read_memory(where), sizes)
    loaded = pipeline.model
    tier = next((t for t in pipeline.store.tiers if isinstance(t, MemoryTier)), None)
    sizes = replace(sizes, memory_bytes=tier and tier.max_bytes, has_memory_tier=tier is not None)
    return plan_memory(loaded.config, loaded.dtype, loaded.device, read_memory(loaded.device), sizes,
                       is_weights_loaded=True)


def sized_store(store: StoreConfig, budget: MemoryBudget) -> StoreConfig:
    """The store's config with its memory tier at the budget's size (unless it has none)."""
    return replace(store, memory_bytes=budget.tier_bytes) if budget.tier_bytes else store
