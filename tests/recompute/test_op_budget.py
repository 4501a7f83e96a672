"""The layer loop's host work, counted on CPU: what a GPU pays per dispatched op (a launch, or at
least the dispatcher's time) and per host read of a device value (a sync that drains the stream).

The counts are aten ops seen by a `TorchDispatchMode` in one `BatchRunner.run` on a 4-layer bf16
model, divided by the layers; a request of 5 chunks (1K context tokens) against one of 20 (4K).
Device-to-host copies (`.cpu()`) are not seen on CPU, where they dispatch nothing: the one a run
makes by design is the ranking of a selection signal's scores (`signals.rank`).
Attention runs as one block per request, the plan a CUDA device uses (on CPU the measured-fastest
plan splits long row sets into more calls: a kernel choice, not loop overhead).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cachesmith.kvstore import ChunkStore, StoreConfig, TransferEngine, put_prompt
from cachesmith.model import Decoder, prefill_chunk
from cachesmith.recompute import BatchRunner, RecomputeRequest, cacheblend, epic, full_reuse

NUM_LAYERS = 4
CHUNK_TOKENS = 200
# reads of a value back to the host: on a device each one waits for the stream to drain
HOST_READS = {"item", "_local_scalar_dense", "is_nonzero", "nonzero", "equal"}
BUDGETS = {"full_reuse": (full_reuse(), 60), "cacheblend@0.15": (cacheblend(0.15), 80),
           "epic@0.15": (epic(0.15), 80)}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def num_host_reads(self) -> int:
        return sum(n for name, n in self.ops.items() if name in HOST_READS)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("op-budget-model")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=NUM_LAYERS,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                                 tie_word_embeddings=False)).save_pretrained(str(path))
    return Decoder(path, "cpu", torch.bfloat16)


def requests_on(model: Decoder) -> dict[int, RecomputeRequest]:
    """num_chunks -> a request of that many stored-size chunks and a 32-token question."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 128, (n,), generator=g).tolist()
    return {k: RecomputeRequest([prefill_chunk(model, ids(CHUNK_TOKENS)) for _ in range(k)], ids(32))
            for k in (5, 20)}


@pytest.fixture(scope="module")
def requests(model):
    return requests_on(model)


def _counted(runner: BatchRunner, request: RecomputeRequest, plan) -> _OpCounter:
    runner.run([request], plan)  # first use builds lazy tables (RoPE): not the steady state
    counter = _OpCounter()
    with counter:
        runner.run([request], plan)
    return counter


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_ops_per_layer_stay_in_budget_and_do_not_grow_with_chunks(model, requests, name):
    plan, budget = BUDGETS[name]
    runner = BatchRunner(model, num_attention_blocks=1)
    per_layer = {k: sum(_counted(runner, r, plan).ops.values()) / NUM_LAYERS for k, r in requests.items()}
    assert per_layer[20] <= 1.1 * per_layer[5], per_layer  # no work per chunk in the loop
    assert per_layer[20] <= budget, per_layer


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_a_run_reads_nothing_back_from_the_device(model, requests, name):
    counter = _counted(BatchRunner(model, num_attention_blocks=1), requests[20], BUDGETS[name][0])
    assert counter.num_host_reads <= 1, {k: v for k, v in counter.ops.items() if k in HOST_READS}


def test_the_counter_sees_host_reads(model, requests):
    """The spy can fail: a run whose caller reads the first token makes exactly that one read."""
    runner = BatchRunner(model, num_attention_blocks=1)
    counter = _OpCounter()
    with counter:
        runner.run([requests[5]], full_reuse())[0].first_token
    assert counter.num_host_reads == 1


def test_staged_requests_do_not_grow_with_chunks(model, requests, tmp_path):
    """Stored chunks staged by the transfer engine: their rows arrive layer by layer and are rotated
    per layer, still with no work per chunk on the runner's thread."""
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    engine, runner, plan = TransferEngine(store, model), BatchRunner(model, num_attention_blocks=1), cacheblend(0.15)
    per_layer = {}
    for k, r in requests.items():
        keyed = put_prompt(store, r.chunks, r.suffix_ids)
        counts = []
        for _ in range(2):  # the second is counted
            with engine.stage([keyed], plan) as batch, _OpCounter() as counter:
                runner.run(batch.requests, plan, batch)
            counts.append(sum(counter.ops.values()) / NUM_LAYERS)
        per_layer[k] = counts[-1]
    engine.close()
    assert per_layer[20] <= 1.1 * per_layer[5], per_layer


# -- the same budgets on the simulated CUDA device, with the plan a CUDA device uses -----------------

@pytest.fixture()
def sim_model(model, sim_cuda):
    """The test model's weights on the simulated device (a fresh load: the module's model is on CPU),
    running the eager layer loop (what a graphed run costs: test_graph_prefill.py)."""
    sim = Decoder(model.model_dir, "cuda", torch.bfloat16)
    sim.is_prefill_graphed = False
    return sim


@pytest.fixture()
def sim_requests(sim_model):
    return requests_on(sim_model)


@pytest.mark.sim_cuda
@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_on_a_cuda_device_ops_per_layer_stay_in_budget_with_no_sync(sim_model, sim_requests, sim_cuda, name):
    """Counted by the simulation (torch calls on device tensors, on every thread), with the runner's
    default plan for a CUDA device: no per-chunk work, no host sync, a fixed few copies in."""
    plan, budget = BUDGETS[name]
    runner = BatchRunner(sim_model)
    per_layer, copies = {}, {}
    for k, request in sim_requests.items():
        runner.run([request], plan)  # first use builds lazy tables (RoPE)
        with sim_cuda.count() as counts:
            runner.run([request], plan)
        assert counts.syncs == 0 and counts.attention["math"] == 0, counts
        per_layer[k], copies[k] = counts.ops / NUM_LAYERS, counts.h2d
    assert per_layer[20] <= 1.1 * per_layer[5] and per_layer[20] <= budget, per_layer
    assert copies[5] == copies[20], copies


@pytest.mark.sim_cuda
def test_on_a_cuda_device_staged_chunks_cost_two_copies_per_layer(sim_model, sim_requests, sim_cuda, tmp_path):
    """Stored chunks reach a device cache through one pinned buffer and one copy per tensor, layer
    and request, however many chunks the request has (they were two copies per chunk and layer)."""
    store = ChunkStore(StoreConfig(tiers=("memory",), root=tmp_path))
    engine, runner, plan = TransferEngine(store, sim_model), BatchRunner(sim_model), cacheblend(0.15)
    copies, per_layer = {}, {}
    for k, r in sim_requests.items():
        keyed = put_prompt(store, r.chunks, r.suffix_ids)
        for _ in range(2):  # the second is counted
            with sim_cuda.count() as counts, engine.stage([keyed], plan) as batch:
                runner.run(batch.requests, plan, batch)
        copies[k], per_layer[k] = counts.h2d, counts.ops / NUM_LAYERS
        assert counts.findings == [] and counts.syncs == 0
    engine.close()
    loaded_layers = NUM_LAYERS - plan.warmup  # a WarmUp layer reads nothing stored
    assert copies[5] == copies[20] == 2 * loaded_layers + 3, copies  # + the run's own three (ids, positions)
    assert per_layer[20] <= 1.15 * per_layer[5], per_layer  # the loaders' per-run device copies
