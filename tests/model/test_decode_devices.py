"""Decoding on each device of the `device` fixture (the CPU, the simulated CUDA device, and a GPU
where torch sees one: `make test-cuda`), in float32 over the shared run of `decoding_runs` (a
fourth sequence joins before step 3, the second leaves halfway): graph steps give the eager steps'
tokens, and both give the CPU's. Simulated-device counts: test_decode_sim.py, test_graph_decode.py.
"""
from __future__ import annotations

import pytest

from cachesmith.model import Decoder
from cachesmith.model.generate import Decoding
from tests.model.decoding_runs import BUDGETS, run_with_join


def _decode(decoding: Decoding) -> list[list[int]]:
    """Tokens of the shared run; the caches released after."""
    gens, _ = run_with_join(decoding)
    for gen in gens:
        gen.cache.release()
    return [g.token_ids for g in gens]


@pytest.fixture(scope="module")
def cpu_tokens(tiny_llama_dir):
    return _decode(Decoding(Decoder(tiny_llama_dir[0], "cpu", "float32"), use_graphs=False))


def test_graph_tokens_equal_eager_ones_as_sequences_join_and_leave(tiny_llama_dir, device):
    """One model, two decodings: graph steps (inert on the CPU) against eager steps. On a CUDA
    device the steps really were replays of captured graphs."""
    model = Decoder(tiny_llama_dir[0], device, "float32")
    eager = Decoding(model, use_graphs=False)
    eager_tokens = _decode(eager)
    graphed = Decoding(model, use_graphs=True)
    graph_tokens = _decode(graphed)
    assert graph_tokens == eager_tokens
    assert [len(t) for t in graph_tokens] == BUDGETS
    assert eager.graphs is None
    if model.device.type == "cuda":
        assert graphed.graphs.num_captures >= 1 and graphed.graphs.num_replays > 0
    else:
        assert graphed.graphs is None


@pytest.mark.parametrize("use_graphs", [True, False])
def test_greedy_tokens_equal_the_cpu_ones(tiny_llama_dir, cpu_tokens, device, use_graphs):
    """On every device, with graph steps or without, float32 decodes the CPU's eager tokens.
    (bfloat16, exact on the simulated device only: test_decode_sim.py.)"""
    tokens = _decode(Decoding(Decoder(tiny_llama_dir[0], device, "float32"), use_graphs))
    assert tokens == cpu_tokens
