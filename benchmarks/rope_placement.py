"""How exactly cached K lands at a new offset: pre-RoPE storage vs post-RoPE + delta rotation.

For a chunk computed in isolation, compares the K placed at offset o with the K the same tokens get
when computed directly at o (layer 0, where no attention has mixed positions in yet, and the last
layer). Rows: dtype, offset, method, max_abs_err, rel_err, place_ms (time to place one layer of a
2K-token context). Usage: python -m benchmarks.rope_placement [--json]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common.payload import emit, print_table
from benchmarks.common.timing import median, timed

from cachesmith.model import Decoder, prefill_chunk, resolve_model


def _place_cost_ms(model: Decoder, keys: torch.Tensor, offset: int, repeats: int = 20) -> float:
    positions = torch.arange(offset, offset + keys.shape[0], device=keys.device)
    return 1e3 * median([timed(lambda: model.rope.rotate(keys, positions)) for _ in range(repeats)])


def run(model_name: str, dtypes: list[str], offsets: list[int], chunk_tokens: int) -> list[dict]:
    rows = []
    path = resolve_model(model_name)
    for dtype in dtypes:
        model = Decoder(path, "cpu", dtype)
        ids = torch.randint(0, model.config.vocab_size, (chunk_tokens,), generator=torch.Generator().manual_seed(0))
        chunk = prefill_chunk(model, ids)
        stored_rotated = [model.rope.rotate(chunk.keys[l], torch.arange(chunk_tokens)) for l in (0, model.num_layers - 1)]
        for offset in offsets:
            cache = model.new_cache(offset + chunk_tokens)
            model.forward(ids, start=offset, cache=cache)
            for li, layer in enumerate((0, model.num_layers - 1)):
                direct = cache.keys[layer][offset:offset + chunk_tokens].float()
                delta_pos = torch.full((chunk_tokens,), offset)
                placed = {"pre_rope": chunk.keys_at(model, layer, offset),
                          "delta": model.rope.rotate(stored_rotated[li], delta_pos)}
                for method, k in placed.items():
                    err = (k.float() - direct).abs()
                    rows.append({"dtype": dtype, "offset": offset, "layer": layer, "method": method,
                                 "max_abs_err": err.max().item(),
                                 "rel_err": (err.norm() / direct.norm()).item()})
        cost = _place_cost_ms(model, torch.cat([chunk.keys[0]] * (2048 // chunk_tokens)), 4096)
        for r in rows:
            if r["dtype"] == dtype:
                r["place_ms_2k"] = cost
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--offsets", type=int, nargs="+", default=[256, 2048, 7680])
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="results/rope_placement.json")
    args = ap.parse_args()
    rows = run(args.model, args.dtypes, args.offsets, args.chunk_tokens)
    emit(rows, args.json, args.out, lambda: print_table(
        rows, ["dtype", "offset", "layer", "method", "max_abs_err", "rel_err", "place_ms_2k"]))


if __name__ == "__main__":
    main()
