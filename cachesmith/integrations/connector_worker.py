"""The vLLM connector's worker, minus vLLM: cachesmith's decoder where vLLM's caches live, and
each prompt's KV built and written into them.

In: at start, the parallel sizes vLLM runs with and the caches it registers (`paged_kv.PagedCache`,
one per decoder layer); then one `Load` per build (a prompt, its parameters, its blocks) with the
plan of an earlier build of the same request, if any. Out: the decoder loaded once, on the caches'
device and in their dtype (its weights' size logged, and refused with a clear message where they
do not fit beside vLLM's), a writer per layer (logged once), and per build a `Built`: the report for
the response, the counters for vLLM's stats, the plan that ran.

A build runs on a stream of its own and waits for it before returning, so a build finished on the
builder thread has its rows in vLLM's cache before vLLM is told the load was received.

Tensor and pipeline parallelism are refused at start (`check_parallel`): a worker builds every KV
head of every layer, and the ranks of one engine would each choose a plan on their own clock, so
their shards could come from different plans (docs/adr/0040-vllm-connector-on-gpus.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cachesmith.integrations.connector_book import Load, StoreSettings
from cachesmith.integrations.connector_builds import Built
from cachesmith.integrations.paged_kv import PagedCache, VllmOps, Writer, describe_writers, writer_for
from cachesmith.integrations.prompt_kv import PARAMS_KEY, LoadReport, PromptPlan, build_prompt_kv
from cachesmith.model import device as accel
from cachesmith.plan_one import one_planner

GB = 1e9


@dataclass(frozen=True)
class Registration:
    """What `register` set up, for the host's log (vLLM's, in the connector)."""
    model: str
    device: str
    dtype: str
    weights_gb: float  # the checkpoint's tensors as loaded
    allocated_gb: float  # device memory the load took (0 on the CPU)
    writers: str  # `paged_kv.describe_writers`

    def lines(self) -> list[str]:
        return [f"CachesmithConnector: {self.model} on {self.device} in {self.dtype}: {self.weights_gb:.2f} GB of "
                f"weights ({self.allocated_gb:.2f} GB allocated), beside vLLM's own",
                f"CachesmithConnector: writers: {self.writers}"]


def check_parallel(tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Refuses parallel sizes above 1, naming them and what runs instead."""
    if tensor_parallel_size != 1 or pipeline_parallel_size != 1:
        raise ValueError(
            f"CachesmithConnector: tensor_parallel_size={tensor_parallel_size}, pipeline_parallel_size="
            f"{pipeline_parallel_size}: the connector supports tensor_parallel_size=1 and "
            "pipeline_parallel_size=1 only (each worker builds every KV head of every layer, and ranks "
            "planning apart could write shards of different plans); serve more with --data-parallel-size, "
            "whose engines each run a connector of their own")


def build_counts(load: Load, report: LoadReport, num_rows: int) -> dict[str, int]:
    """One build's counters for vLLM's stats (`vllm_stats.SERIES`)."""
    outcome = "prompts_rebuilt" if load.num_rebuilds else "prompts_built"
    return {outcome: 1, "chunks_stored": report.num_chunks_stored, "chunks_prefilled": report.num_chunks_prefilled,
            "stored_tokens": report.num_stored_tokens, "recomputed_tokens": report.num_recomputed_tokens,
            "written_tokens": num_rows}


class ConnectorWorker:
    def __init__(self, model_name: str, store: StoreSettings, block_size: int, ops: VllmOps = VllmOps()) -> None:
        self.model_name, self.store, self.ops = model_name, store, ops
        self.block_size = block_size  # vLLM's scheduler block: a load's slots are block id * it + offset
        self.pipe = None  # cachesmith's pipeline, loaded by `register`
        self.writers: dict[int, Writer] = {}  # decoder layer index -> its cache's writer
        self._stream = None

    def register(self, caches: list[PagedCache]) -> Registration:
        """Loads the decoder where the caches live and picks each layer's writer (at vLLM's start, so
        no request pays for loading the weights or calibrating the planner's profile)."""
        if not caches:
            raise ValueError("CachesmithConnector: vLLM registered no KV cache")
        devices = {str(accel.normalize(c.kv_cache.device)) for c in caches}
        dtypes = {c.kv_cache.dtype for c in caches}
        if len(devices) != 1 or len(dtypes) != 1:
            raise ValueError(f"CachesmithConnector: caches on {sorted(devices)} in {sorted(map(str, dtypes))}; "
                             "the connector builds on one device in one dtype")
        named = {c.layer_index: writer_for(c, self.ops) for c in caches}  # checks each cache first
        device, dtype = accel.normalize(caches[0].kv_cache.device), str(caches[0].kv_cache.dtype).removeprefix("torch.")
        before = accel.memory_allocated(device)
        self.pipe = self._load(device, dtype)
        allocated = accel.memory_allocated(device) - before
        self._check_model(caches)
        self.writers = {i: writer for i, (_, writer) in named.items()}
        self._stream = accel.new_stream(device)
        one_planner(self.pipe)
        weights = sum(t.numel() * t.element_size() for t in self.pipe.model.weight_tensors())
        writers = describe_writers({i: name for i, (name, _) in named.items()}, {c.layer_index: c.backend for c in caches})
        return Registration(self.model_name, str(device), dtype, weights / GB, allocated / GB, writers)

    def _load(self, device, dtype: str):
        from cachesmith.kvstore import ChunkStore
        from cachesmith.pipeline import RagPipeline

        try:
            return RagPipeline(self.model_name, device=str(device), dtype=dtype, store=ChunkStore(self.store.config()))
        except (MemoryError, torch.OutOfMemoryError) as exc:
            raise MemoryError(f"CachesmithConnector: no room on {device} for {self.model_name} in {dtype} beside "
                              "vLLM's KV cache; lower --gpu-memory-utilization (docs/vllm.md)") from exc

    def _check_model(self, caches: list[PagedCache]) -> None:
        cfg = self.pipe.model.config
        layers = sorted(c.layer_index for c in caches)
        shapes = {(c.num_kv_heads, c.head_dim) for c in caches}
        if layers != list(range(cfg.num_layers)) or shapes != {(cfg.num_kv_heads, cfg.head_dim)}:
            raise ValueError(f"CachesmithConnector: model {self.model_name!r} has {cfg.num_layers} layers of "
                             f"{cfg.num_kv_heads} KV heads x {cfg.head_dim}; vLLM's caches are layers "
                             f"{layers[0]}-{layers[-1]} of {sorted(shapes)}: extra config 'model' must name the "
                             "weights vLLM serves")

    def build(self, load: Load, plan: PromptPlan | None) -> Built:
        """Builds one prompt's KV and writes it into the load's blocks (on the builder thread when
        asynchronous); returns once the rows are in vLLM's cache."""
        if self.pipe is None:
            raise RuntimeError("CachesmithConnector: a build before vLLM registered its KV caches")
        waited_s = max(0.0, time.time() - load.arrival_time)
        with accel.on_stream(self._stream):
            kv = build_prompt_kv(self.pipe, load.token_ids, load.params, waited_s,
                                 namespace=load.namespace, plan=plan)
        try:
            with accel.on_stream(self._stream):
                n = load.num_rows
                slots = load.slots(self.block_size).to(self.pipe.model.device)  # [n] int64
                for i, write in self.writers.items():
                    write(kv.cache.key_slab[i, :n], kv.cache.value_slab[i, :n], slots)
        finally:
            # the rows are written before vLLM hears the load ended, and the slabs go back to the
            # pool only once the stream has read them (another build may take them at once)
            self._stream.synchronize()
            kv.cache.release()
        params = kv.report.to_params()
        params[PARAMS_KEY]["num_rebuilds"] = load.num_rebuilds
        return Built(params, build_counts(load, kv.report, load.num_rows), kv.plan)
