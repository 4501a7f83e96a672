"""What the serving front takes and hands back: its config, a completion's spec (documents as texts
or stored chunk ids, a question, an SLO, sampling, the caller), a stored chunk's record, and the
errors a chunk id can meet. Plain values: the HTTP layer builds them, `Service` consumes them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from cachesmith.engine import EngineConfig
from cachesmith.errors import CachesmithError, ConfigError, InputError
from cachesmith.kvstore import StoreConfig
from cachesmith.model.sampling import GREEDY, SamplingParams
from cachesmith.request import DEFAULT_SLO_S, MAX_SLO_S
from cachesmith.scheduler import SchedulerConfig
from cachesmith.scheduler.feasibility import SheddingConfig
from cachesmith.server.memory_budget import ExplicitSizes
from cachesmith.server.tenancy import Caller

DEFAULT_MAX_STORE_TOKENS = 32_768  # tokens one request may add to the store


class ChunkInUse(CachesmithError):
    """A chunk an in-flight request reads cannot be deleted until that request is done."""


class UnknownChunk(InputError):
    """A document names a chunk id the store does not hold for its caller (a 404: the request may
    be right). Another tenant's entry is unknown in the same words: its existence is not told."""


class StoreUnavailable(CachesmithError):
    """A store tier cannot do what was asked now (down, read-only): a 503, worth retrying."""


class SharedChunk(CachesmithError):
    """A chunk shared by every tenant (chunks shared on purpose) is not one tenant's to delete."""


@dataclass(frozen=True)
class ServiceConfig:
    model: str = "smollm2-135m"
    device: str = "cpu"
    dtype: str = "float32"
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(clock="live"))
    store: StoreConfig = field(default_factory=StoreConfig)
    profile_path: Path | None = None  # default: measured here, else the packaged one (calibrated)
    served_name: str | None = None  # the model id clients name (default: `model`)
    max_queue: int = 64
    # refuse at arrival (429) a request whose earliest first token is past 1.5x its SLO, and answer a
    # queued one refused once its deadline is past by the margin (SheddingConfig(None): queue all)
    shedding: SheddingConfig = field(default_factory=SheddingConfig)
    default_slo_s: float = DEFAULT_SLO_S
    max_slo_s: float = MAX_SLO_S
    min_slo_s: float = 1e-3  # below 1 ms no batch can run
    default_max_tokens: int = 64
    max_tokens_limit: int = 512
    max_documents: int = 64
    is_decode_overlapped: bool = True  # decode on its own thread (False: between batches)
    is_graphed: bool = True  # on CUDA, greedy decode steps and graphable recompute runs replay CUDA graphs (False: eager)
    # document chunks in one namespace for every tenant (a public corpus); prefixes stay private
    is_chunk_shared: bool = False
    max_store_tokens_per_request: int = DEFAULT_MAX_STORE_TOKENS  # new tokens a request may store
    tenant_max_bytes: int | None = None  # stored bytes per tenant (its namespaces); None: no cap
    # None: sized to the machine at start (`memory_budget`), with `store.memory_bytes`
    kv_capacity_tokens: int | None = None  # the scheduler's KV resident at once
    kv_pool_bytes: int | None = None  # released KV slabs kept for reuse

    def __post_init__(self) -> None:
        if self.engine.clock != "live":
            raise ConfigError(f"engine.clock={self.engine.clock!r}: a server runs on the live clock")
        if self.engine.scheduler.kv_capacity_tokens != SchedulerConfig.kv_capacity_tokens:
            # the server's KV capacity is sized with its pool and memory tier: one place sets it
            raise ConfigError(f"engine.scheduler.kv_capacity_tokens={self.engine.scheduler.kv_capacity_tokens}: "
                              f"a server takes its KV capacity from kv_capacity_tokens (None: sized to the machine)")
        self.memory_sizes  # validates them
        if not isinstance(self.is_graphed, bool):
            raise ConfigError(f"is_graphed={self.is_graphed!r} must be True or False")
        if self.tenant_max_bytes is not None and self.tenant_max_bytes < 1:
            raise ConfigError(f"tenant_max_bytes={self.tenant_max_bytes} must be positive (None: no cap)")
        for name in ("max_queue", "default_max_tokens", "max_tokens_limit", "max_documents",
                     "max_store_tokens_per_request"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ConfigError(f"default_max_tokens={self.default_max_tokens} exceeds max_tokens_limit="
                              f"{self.max_tokens_limit}")
        if not (0 < self.min_slo_s <= self.default_slo_s <= self.max_slo_s and math.isfinite(self.max_slo_s)):
            raise ConfigError(f"need 0 < min_slo_s ({self.min_slo_s}) <= default_slo_s ({self.default_slo_s}) "
                              f"<= max_slo_s ({self.max_slo_s}) < inf")

    @property
    def name(self) -> str:
        return self.served_name or self.model

    @property
    def memory_sizes(self) -> ExplicitSizes:
        """The memory sizes set here (None: sized to the machine at start)."""
        return ExplicitSizes(self.kv_capacity_tokens, self.kv_pool_bytes, self.store.memory_bytes,
                             "memory" in self.store.tiers)


@dataclass(frozen=True)
class DocumentRef:
    """One retrieved passage: its text, or the id of a chunk already in the store."""
    text: str | None = None
    chunk_id: str | None = None


@dataclass(frozen=True)
class CompletionSpec:
    documents: tuple[DocumentRef, ...]
    question: str
    system: str = ""
    max_tokens: int | None = None  # None: the service default
    slo_s: float | None = None  # None: the service default
    gold: tuple[str, ...] = ()  # optional: gates the answer (QSA metrics) when given
    task: str = "custom"  # how the gate scores the answer (a workload task name, or custom)
    answer_prefix: str = ""  # opens the assistant turn; the model continues it
    sampling: SamplingParams = GREEDY
    history: tuple[tuple[str, str], ...] = ()  # earlier chat turns (role, content), before the documents
    is_chat: bool = False  # a chat turn: its exchange is stored for the conversation's next turn
    stop: tuple[str, ...] = ()  # where the client's text ends (what the next turn will send back)
    caller: Caller = Caller()  # the tenant (from the API key) and the request's cache_salt
    # every answer budget the request gave, by field (chat may give two; `max_tokens` is the tightest)
    max_tokens_fields: tuple[tuple[str, int], ...] = ()

    @property
    def text_field(self) -> str:
        """The request field holding the client's own text: `messages` (a chat) or `prompt`."""
        return "messages" if self.is_chat else "prompt"


@dataclass(frozen=True)
class ChunkRecord:
    chunk_id: str
    num_tokens: int
    tiers: tuple[str, ...]
    text: str
    is_new: bool = False
    is_shared: bool = False  # a document chunk every tenant reads (chunks shared on purpose)

    def to_dict(self) -> dict:
        return {"id": self.chunk_id, "object": "chunk", "num_tokens": self.num_tokens,
                "tiers": list(self.tiers), "text": self.text, "is_new": self.is_new, "shared": self.is_shared}
