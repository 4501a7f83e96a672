"""`benchmarks/gpu_forecast.py` end to end on tiny random models (2 and 3 layers, one 1K size): every
run is recorded, scaled to 32 layers, fit and laid out in rows and bars. The forecast's own figures
need the 8B shape (`python -m benchmarks.gpu_forecast`)."""
from __future__ import annotations

import pytest

from benchmarks import gpu_forecast as forecast
from cachesmith.recompute import graph_prefill
from cachesmith.testing.sim_clock import H100
from tests.recompute.test_graph_prefill import save_llama

pytestmark = pytest.mark.sim_cuda


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("forecast")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(forecast, "DECODE_CONTEXT", 256)  # the decode runs' prefill: small here
        # full reuse's question rows within it at 32 layers, CacheBlend's full layer 0 and selection over
        patch.setattr(graph_prefill, "MAX_ROW_PARAMS", 3_000_000)
        return [forecast.traces_of(save_llama(root / f"l{n}", n, hidden=64), [1024]) for n in forecast.LAYERS]


def test_every_run_is_recorded_and_scaled_term_by_term(traces):
    two, three = traces
    assert set(two) == set(three) == {"prefill 1024", "decode 1 eager", "decode 1 graph", "decode 8 eager",
                                      "decode 8 graph"} | {f"{name} 1024 {mode}" for name in ("full_reuse", "cacheblend")
                                                           for mode in ("eager", "graph")} | {"cacheblend 1024 replay"}
    at_32 = forecast.at_32(two, three, H100)
    eager, graphed = at_32["full_reuse 1024 eager"], at_32["full_reuse 1024 graph"]
    assert graphed.num_calls < 40 < eager.num_calls  # the replayed run's host calls do not grow with layers
    # graphs on runs CacheBlend eager, as a 32-layer model would; `replay` forces the graph
    assert two["cacheblend 1024 graph"] is two["cacheblend 1024 eager"]
    assert at_32["cacheblend 1024 replay"].num_calls < 40 < at_32["cacheblend 1024 graph"].num_calls
    assert at_32["prefill 1024"].num_kernels > 32 * 5  # each of the 32 layers launches its kernels


def test_the_rows_and_bars_name_what_binds_them(traces):
    two, three = traces
    spec = H100.with_fit(compute_efficiency=0.5)
    rows = forecast.rows_for(spec, forecast.at_32(two, three, spec), [1024])
    assert {r["row"] for r in rows} == {"full_prefill", "full_reuse", "cacheblend", "decode x1", "decode x8"}
    assert all(r["binding"] in ("host", "compute", "memory", "link") for r in rows)
    assert all(r["ms"] > 0 for r in rows)
    assert all(r["tokens_per_s"] > 0 for r in rows if r["row"].startswith("decode"))


def test_the_bars_read_the_h100_graphed_rows_and_say_what_binds():
    def row(name, tokens, graphs, **fields):
        return {"device": "H100 SXM", "row": name, "tokens": tokens, "graphs": graphs, "binding": "memory", **fields}
    rows = [row("full_reuse", 2048, True, vs_full_prefill=0.14), row("full_reuse", 2048, False, vs_full_prefill=0.5),
            row("cacheblend", 2048, True, vs_full_prefill=0.36), row("cacheblend", 16384, True, vs_full_prefill=0.2),
            row("decode x1", forecast.DECODE_CONTEXT, True, tokens_per_s=120.0),
            row("decode x8", forecast.DECODE_CONTEXT, True, tokens_per_s=400.0)]
    met = {b["bar"]: b["is_met"] for b in forecast.bars(rows)}
    assert met == {"full reuse 2K / full prefill": True, "CacheBlend@15% 2K / full prefill": False,
                   "CacheBlend@15% 16K / full prefill": True, "decode 1 stream, tokens/s": True,
                   "decode 8 streams, tokens/s": False}
