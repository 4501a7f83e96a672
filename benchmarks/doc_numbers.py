"""The numbers the documents quote, checked against the payloads they come from.

In: `QUOTES`, one entry per quoted number: the document, the text around the number (`{}` marks
the number; any run of spaces or line breaks in the text matches any other), the payload in
`docs/bench/` (or `docs/results/`), the path to the value in it, and how the document writes it
(a format spec after a scale, or a conversion). Out: exit status 0 when every quote agrees with its
payload; otherwise 1, and one line per disagreement naming the document, the number it quotes,
the payload, the key path and the value the payload gives. A quote whose text is no longer in its
document fails too (the number was reworded or removed: move the quote with it). Every occurrence
of a quote's text must agree.

`python -m benchmarks.doc_numbers` checks; `--list` prints every quote beside its payload's value;
`--root DIR` checks another checkout. Standard library only, so it runs before any install.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?"

Key = tuple  # str: a dict key; int: a list index; dict: the first list item whose fields equal it


@dataclass(frozen=True)
class Quote:
    doc: str  # the document, relative to the repository root
    text: str  # the text around the number; "{}" marks it
    payload: str  # the payload, relative to the repository root (.json, or .jsonl: a list of rows)
    key: Key  # where the value lies in the payload
    fmt: str = ""  # format spec of the value as the document writes it ("" with `convert`)
    scale: float = 1.0  # the value is multiplied by this first (100: a fraction quoted as a percentage)
    convert: Callable[[object], str] | None = None  # for values that are not plain numbers

    def pattern(self) -> re.Pattern:
        before, after = self.text.split("{}")
        def words(part: str) -> str:
            return r"\s+".join(re.escape(w) for w in part.split()) if part.strip() else ""
        lead = words(before) + (r"\s+" if before[-1:].isspace() else "")
        tail = (r"\s+" if after[:1].isspace() else "") + words(after)
        return re.compile(lead + f"({NUMBER})" + tail)

    def expected(self, value: object) -> str:
        if self.convert is not None:
            return self.convert(value)
        return format(float(value) * self.scale, self.fmt)

    def where(self) -> str:
        return f"{self.payload} {key_text(self.key)}"


def before_slash(value: object) -> str:
    """'86/96' -> '86'."""
    return str(value).split("/")[0]


def strip_percent(value: object) -> str:
    """'57.1%' -> '57.1'."""
    return str(value).rstrip("%")


GRID = "docs/bench/signal_rule_grid.json"
POOLED = "docs/bench/replay_confirm_pooled_vs_cacheblend.json"
SERVE = "docs/bench/serve_load.json"
DECODE = "docs/bench/decode.json"
ANCHOR = "docs/bench/vllm_anchor.json"
PLUGIN = "docs/bench/vllm_plugin_ttft.json"
MACHINE = "docs/bench/machine.json"
SIM = "docs/bench/sim_validation.json"
REUSE = "docs/bench/reuse_2k.json"
FORECAST = "docs/bench/gpu_forecast.json"
HELD_OUT = "docs/bench/held_out_demand.json"
KV_CODEC = "docs/bench/kv_codec.json"
ROBUST = ("rows", {"method": "cachesmith"})
POISSON = ("summary", {"setting": "poisson-u0.7"})
F32_1K = ({"dtype": "float32", "context_tokens": 1024, "streams": 1},)
SIM_POISSON = ({"setting": "measured-instances-poisson-u0.7-n96", "method": "cachesmith"},)
SHUFFLED_2K = {"case": "shuffled", "context_tokens": 2048}

OVERLOAD = "docs/bench/overload.json"
BURST = OVERLOAD  # the run serves the burst too
BURST_ON = ("rows", {"run": "burst of 40, new documents", "shedding": "1.5x"})


COST = "docs/bench/cost_model.json"
BIAS = "docs/bench/cost_bias.json"
CLUSTER = "docs/bench/redis_cluster.json"
SIM_CHECK = "docs/bench/sim_check.json"


def _family(name: str, field: str) -> tuple:
    return ("families", {"family": name}, field)


def _level(name: str, field: str) -> tuple:
    return ("by_load", {"level": name}, field)


def _paired(name: str, field: str) -> tuple:
    return ("paired", {"level": name}, field)


QUOTES: tuple[Quote, ...] = (
    Quote("docs/measurements.md", "| full_reuse | 5 | {}% |", BIAS, _family("full_reuse", "bias"), ".1f", scale=100),
    Quote("docs/measurements.md", "| position/1/0 | 10 | +{}% |", BIAS, _family("position/1/0", "bias"), ".1f", scale=100),
    Quote("docs/measurements.md", "| qci_last/0/1 | 10 | {}% |", BIAS, _family("qci_last/0/1", "bias"), ".1f", scale=100),
    Quote("docs/measurements.md", "| 2x Poisson | {} | 224 |", OVERLOAD, _level("2x poisson", "on_time_on"), ".0f"),
    Quote("docs/measurements.md", "| 4x Poisson | 160 | {} |", OVERLOAD, _level("4x poisson", "on_time_off"), ".0f"),
    Quote("docs/measurements.md", "| 22.7% | 22.4% | +0.3 points [-3.4, +{}]", OVERLOAD, _paired("2x poisson", "qsa_diff_hi"),
          ".1f", scale=100),
    Quote("docs/measurements.md", "| 47.4% | 47.4% | +0.0 points [{}, +2.3]", OVERLOAD,
          _paired("0.5x poisson", "qsa_diff_lo"), ".1f", scale=100),
    Quote("docs/measurements.md", "| 20.6% | 22.7% | -2.1 points [-5.2, +{}]", OVERLOAD,
          _paired("2x gamma cv4", "qsa_diff_hi"), ".1f", scale=100),
    Quote("docs/measurements.md", "{} requests over the Gamma CV 4 traces", OVERLOAD,
          _paired("2x gamma cv4", "refused_arrival_on"), ".0f"),
    Quote("docs/measurements.md", "the run first in its pair answered {} on time at 1x Poisson", OVERLOAD,
          _level("1x poisson", "on_time_first"), ".0f"),
    Quote("docs/measurements.md", "shedding off\n  ({} requests/s)", OVERLOAD, ("capacity_rps",), ".2f"),
    Quote("docs/measurements.md", "CacheSmith, SLO 2x a measured base of {} s", OVERLOAD, ("base_slo_s",), ".2f"),
    Quote("docs/measurements.md", "2 are answered, at a P99 TTFT of {}x", BURST, BURST_ON + ("ttft_p99_vs_slo",), ".3f"),
    Quote("docs/measurements.md", "with shedding {} are refused at arrival", BURST, BURST_ON + ("refused_arrival",), ".0f"),
    Quote("docs/measurements.md", "({} ms at the median)", BURST, BURST_ON + ("refusal_ms_p50",), ".0f"),
    Quote("docs/measurements.md", "refused at arrival, within {} ms", BURST, BURST_ON + ("refusal_ms_max",), ".0f"),
    Quote("docs/measurements.md", "the last {} s after the burst", BURST, BURST_ON + ("shed_queued_s_max",), ".1f"),
    Quote("docs/measurements.md", "at a peak resident set of {} GiB", BURST, ("small_machine", "peak_rss_bytes"), ".1f",
          scale=1 / (1 << 30)),
    Quote("docs/measurements.md", "| kv_dev/1/1 | 20 | {}% |", COST, _family("kv_dev/1/1", "median_abs_rel_err"), ".1f",
          scale=100),
    Quote("docs/measurements.md", "| qci_last/0/1 | 20 | {}% |", COST, _family("qci_last/0/1", "median_abs_rel_err"), ".1f",
          scale=100),
    Quote("docs/measurements.md", "| position/0/0 | 20 | {}% |", COST, _family("position/0/0", "median_abs_rel_err"),
          ".1f", scale=100),
    Quote("docs/measurements.md", "| poisson | cachesmith | {}% |", SIM_CHECK,
          ("rows", {"setting": "measured-instances-poisson-u0.7-n16", "method": "cachesmith"}, "qsa_replay"), ".1f",
          scale=100),
    Quote("docs/measurements.md", "| gamma-cv2 | cacheblend@0.15 | 37.5% | 37.5% | 2.93 | 2.43, {}% |", SIM_CHECK,
          ("rows", {"setting": "measured-instances-gamma-cv2-u0.7-n16", "method": "cacheblend@0.15"}, "p99_rel_err"),
          "+.1f", scale=100),
    Quote("docs/measurements.md", "| gamma-cv3 | cachesmith | 62.5% | {}% |", SIM_CHECK,
          ("rows", {"setting": "measured-instances-gamma-cv3-u0.7-n16", "method": "cachesmith"}, "qsa_sim"), ".1f",
          scale=100),
    Quote("docs/measurements.md", "check (`benchmarks/sim_validation.py`, `docs/bench/sim_check.json`,\n{} minutes)",
          SIM_CHECK, ("wall_s",), ".1f", scale=1 / 60),
    Quote("docs/measurements.md", "2K-token entry: int8 {}x float32's", KV_CODEC,
          ("bytes", {"dtype": "float32", "codec": "int8"}, "vs_none"), ".3f"),
    Quote("docs/measurements.md", "x float32's and {}x bfloat16's", KV_CODEC,
          ("bytes", {"dtype": "bfloat16", "codec": "int8"}, "vs_none"), ".3f"),
    Quote("docs/measurements.md", "int4 {}x float32's. A 2K-token", KV_CODEC,
          ("bytes", {"dtype": "float32", "codec": "int4"}, "vs_none"), ".3f"),
    Quote("docs/measurements.md", "takes {}x the exact entries' time", KV_CODEC,
          ("speed", {"codec": "int8"}, "read_vs_none"), ".2f"),
    Quote("docs/measurements.md", "with int8 and {}x with int4", KV_CODEC, ("speed", {"codec": "int4"}, "read_vs_none"), ".2f"),
    Quote("docs/measurements.md", "hits {}% /", KV_CODEC, ("capacity", {"codec": "none"}, "hit_rate"), ".1f", 100),
    Quote("docs/measurements.md", "% / {}% / ", KV_CODEC, ("capacity", {"codec": "int8"}, "hit_rate"), ".1f", 100),
    Quote("docs/measurements.md", "{}% of its reads", KV_CODEC, ("capacity", {"codec": "int4"}, "hit_rate"), ".1f", 100),
    # docs/measurements.md: at a glance
    Quote("docs/measurements.md", "than the best static method (BestStatic, chosen in hindsight) in {} of 96",
          GRID, ROBUST + ("above_best_static",), convert=before_slash),
    Quote("docs/measurements.md", "at least Full Prefill's in {} of 96", GRID, ROBUST + ("at_or_above_full_prefill",),
          convert=before_slash),
    Quote("docs/measurements.md", "CacheSmith leads CacheBlend@15% by +{} points of QSA under Poisson arrivals",
          POOLED, POISSON + ("lead_pts",), ".1f"),
    Quote("docs/measurements.md", "under Poisson arrivals ({}% against", POOLED, POISSON + ("cachesmith",), ".1f", 100),
    Quote("docs/measurements.md", "% against {}%, 4 seeds)", POOLED, POISSON + ("best_static_qsa",), ".1f", 100),
    Quote("docs/measurements.md", "+{} under Gamma CV 2", POOLED, ("summary", {"setting": "gamma-cv2-u0.7"}, "lead_pts"), ".1f"),
    Quote("docs/measurements.md", "and +{} under Gamma CV 3", POOLED, ("summary", {"setting": "gamma-cv3-u0.7"}, "lead_pts"),
          ".1f"),
    Quote("docs/measurements.md", "{}% QSA live against", SERVE, ("rows", {"run": "live (server clock)"}, "qsa"), ".0f", 100),
    Quote("docs/measurements.md", "live against {}% for the same trace", SERVE, ("rows", {"run": "replay"}, "qsa"), ".0f", 100),
    Quote("docs/measurements.md", "at 1K context, {} tokens/s on the native kernels", DECODE, F32_1K + ("tokens_per_s",), ".1f"),
    Quote("docs/measurements.md", "on the native kernels against {} for llama.cpp", DECODE, F32_1K + ("llama_cpp_tokens_per_s",),
          ".1f"),
    # docs/measurements.md: beside vLLM and llama.cpp
    Quote("docs/measurements.md", "TTFT in one run: vLLM {} s,", ANCHOR, ("rows", {"server": "vllm", **SHUFFLED_2K}, "ttft_s"),
          ".2f"),
    Quote("docs/measurements.md", "llama.cpp {} s, cachesmith (CacheBlend@15%)", ANCHOR,
          ("rows", {"server": "llama.cpp", **SHUFFLED_2K}, "ttft_s"), ".2f"),
    Quote("docs/measurements.md", "cachesmith (CacheBlend@15%) {} s;", ANCHOR,
          ("rows", {"server": "cachesmith cacheblend@0.15", **SHUFFLED_2K}, "ttft_s"), ".2f"),
    Quote("docs/measurements.md", "vLLM with the plugin {}x vLLM alone", PLUGIN, ("ratio_shuffled", "cacheblend@0.15", "2048"),
          ".2f"),
    Quote("docs/measurements.md", "fixed, and {}x with the", PLUGIN, ("ratio_shuffled", "cachesmith", "2048"), ".2f"),
    Quote("docs/measurements.md", "quality needs it ({}x", PLUGIN, ("ratio_shuffled", "cachesmith", "1024"), ".2f"),
    Quote("docs/measurements.md", "at 1K, {}x at 4K", PLUGIN, ("ratio_shuffled", "cachesmith", "4096"), ".2f"),
    Quote("docs/vllm.md", "66-68% coverage ({}x: the planner", PLUGIN, ("ratio_shuffled", "cachesmith", "2048"), ".2f"),
    # docs/results.md: the simulator's setup and its validation
    Quote("docs/results.md", "profile rescaled by this machine's speed factor {},", MACHINE, ("speed_factor",), ".2f"),
    Quote("docs/results.md", "kv_dev/1/0 {}x,", MACHINE, ("machine", "paces", "kv_dev/1/0"), ".2f"),
    Quote("docs/results.md", "qci_last/1/1 {}x)", MACHINE, ("machine", "paces", "qci_last/1/1"), ".2f"),
    Quote("docs/results.md", "Base SLO {} s = mean single-request", "docs/results/grid.jsonl", (0, "base_slo_s"),
          ".2f"),
    Quote("docs/results.md", "| measured-instances-poisson-u0.7-n96 | 0,1 | cachesmith | {}% |", SIM,
          ("rows",) + SIM_POISSON + ("qsa_replay",), ".0f", 100),
    Quote("docs/results.md", "| cachesmith | 64% | {}% | -4.7 |", SIM, ("rows",) + SIM_POISSON + ("qsa_sim",), ".0f",
          100),
    Quote("docs/results.md", "| 64% | 59% | {} | 3.78 |", SIM, ("rows",) + SIM_POISSON + ("qsa_diff_pts",), "+.1f"),
    Quote("docs/results.md", "| -4.7 | {} | 3.78 | -0.2% |", SIM, ("rows",) + SIM_POISSON + ("p99_replay_s",), ".2f"),
    Quote("docs/results.md", "| measured-instances-gamma-cv3-u0.7-n96 | 0,1 | cachesmith | 47% | 39% | {} |", SIM,
          ("cross_validated", {"setting": "measured-instances-gamma-cv3-u0.7-n96", "method": "cachesmith"},
           "qsa_diff_pts"), "+.1f"),
    # docs/measurements.md: the headlines
    Quote("docs/measurements.md", "BestStatic in **{} of the paper's 96**", GRID, ROBUST + ("above_best_static",),
          convert=before_slash),
    Quote("docs/measurements.md", "with a mean QSA of {}% over the 96", GRID, ROBUST + ("mean_qsa",),
          convert=strip_percent),
    Quote("docs/measurements.md", "+10.4 points at Poisson u0.7 (4 seeds, {}% against", POOLED,
          POISSON + ("cachesmith",), ".1f", 100),
    Quote("docs/measurements.md", "| replay clock (engine) | {}% |", SERVE, ("rows", {"run": "replay"}, "qsa"), ".0f",
          100),
    Quote("docs/measurements.md", "(2K context, batches 1 / 4 / 8) | {} /", REUSE,
          ("rows", {"dtype": "float32", "context_tokens": 2048, "batch_size": 1}, "vs_limit"), ".2f"),
    Quote("docs/measurements.md", "| float32 | 1K | {} | 156.1 |", DECODE, F32_1K + ("tokens_per_s",), ".1f"),
    Quote("docs/measurements.md", "- 50 requests: {} s, 14.4 minutes", "docs/bench/workload_profile.json",
          ("rows", 0, "wall_s"), ".1f"),
    Quote("docs/measurements.md", "| 2K | 3.03 s | 2.60 s | 0.72 s ({}x) |", PLUGIN,
          ("ratio_shuffled", "cacheblend@0.15", "2048"), ".2f"),
    Quote("docs/evaluation.md", "`docs/bench/signal_rule_grid.json`: {} of 96 above", GRID,
          ROBUST + ("above_best_static",), convert=before_slash),
    # docs/measurements.md: the demand fit crossed with held-out samples
    Quote("docs/measurements.md", "trails by up to {} points on the evaluation table", HELD_OUT,
          ("trail_summary", "held_out_a", "max"), ".1f"),
    Quote("docs/measurements.md", "and by {} pooled over both held-out directions", HELD_OUT,
          ("trail_summary", "crossfit", "max"), ".1f"),
    # docs/measurements.md: the GPU forecast
    Quote("docs/measurements.md", "full prefill at 8K and 16K: {} ms against 229", FORECAST,
          ("held_out", {"tokens": 8192}, "forecast_ms"), ".1f"),
    Quote("docs/measurements.md", "(+3.1%) and {} ms", FORECAST, ("held_out", {"tokens": 16384}, "forecast_ms"), ".1f"),
    Quote("docs/measurements.md", "| full reuse at 2K / full prefill | {} |", FORECAST,
          ("bars", {"bar": "full reuse 2K / full prefill"}, "forecast"), ".3f"),
    Quote("docs/measurements.md", "| CacheBlend@15% at 16K / full prefill | {} (run eager) |", FORECAST,
          ("bars", {"bar": "CacheBlend@15% 16K / full prefill"}, "forecast"), ".3f"),
    Quote("docs/measurements.md", "| decode, 1 stream, tokens/s | {} |", FORECAST,
          ("bars", {"bar": "decode 1 stream, tokens/s"}, "forecast"), ".1f"),
    Quote("docs/measurements.md", "| decode, 8 streams, tokens/s | {} |", FORECAST,
          ("bars", {"bar": "decode 8 streams, tokens/s"}, "forecast"), ".1f"),
    Quote("docs/measurements.md", "| CacheBlend@15% at 2K / full prefill | {} |", FORECAST,
          ("bars", {"bar": "CacheBlend@15% 2K / full prefill"}, "forecast"), ".3f"),
    Quote("docs/measurements.md", "replayed it would take 51.99 and\n{} ms", FORECAST,
          ("rows", {"device": "H100 SXM", "row": "cacheblend", "tokens": 16384, "graphs": "forced"}, "ms"), ".1f"),
    # docs/serving.md: the Redis Cluster recipe
    Quote("docs/serving.md", "held {}x the 256 KiB entries of one server", CLUSTER, ("capacity", "ratio"), ".2f"),
    Quote("docs/serving.md", "at {} ms against 0.74 ms for a 256 KiB write", CLUSTER, ("write_ms", "put_replicated"),
          ".2f"),
    Quote("docs/serving.md", "at 1.35 ms against {} ms for a 256 KiB write", CLUSTER, ("write_ms", "put"), ".2f"),
)


def key_text(key: Key) -> str:
    parts = []
    for step in key:
        if isinstance(step, dict):
            parts.append("[" + ",".join(f"{k}={v}" for k, v in step.items()) + "]")
        elif isinstance(step, int):
            parts.append(f"[{step}]")
        else:
            parts.append(f"/{step}")
    return "".join(parts)


def lookup(data: object, key: Key) -> object:
    """The value at `key`; KeyError naming the step that is missing."""
    for step in key:
        if isinstance(step, dict):
            if not isinstance(data, list):
                raise KeyError(f"{key_text((step,))}: not a list")
            match = [row for row in data if isinstance(row, dict)
                     and all(str(row.get(k)) == str(v) for k, v in step.items())]
            if not match:
                raise KeyError(f"{key_text((step,))}: no such row")
            data = match[0]
        elif isinstance(step, int):
            if not isinstance(data, list) or not -len(data) <= step < len(data):
                raise KeyError(f"[{step}]: no such item")
            data = data[step]
        else:
            if not isinstance(data, dict) or step not in data:
                raise KeyError(f"/{step}: no such key")
            data = data[step]
    return data


def load_payload(path: Path) -> object:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def check_quote(quote: Quote, doc_text: str, payload: object) -> list[str]:
    """What is wrong with one quote: [] when every occurrence agrees with the payload."""
    try:
        expected = quote.expected(lookup(payload, quote.key))
    except (KeyError, TypeError, ValueError) as exc:
        return [f"{quote.doc}: quote {quote.text!r}: {quote.where()} cannot be read ({exc})"]
    found = quote.pattern().findall(doc_text)
    if not found:
        return [f"{quote.doc}: the text {quote.text!r} is not found (its payload {quote.where()} gives "
                f"{expected}); reworded or removed? move the quote in benchmarks/doc_numbers.py with it"]
    return [f"{quote.doc}: quotes {number} in {quote.text!r}, but {quote.where()} gives {expected}"
            for number in found if number.replace(",", "") != expected.replace(",", "")]


def check(quotes: tuple[Quote, ...] = QUOTES, root: Path = ROOT) -> list[str]:
    """Every disagreement between the documents under `root` and their payloads."""
    problems: list[str] = []
    docs: dict[str, str] = {}
    payloads: dict[str, object] = {}
    for quote in quotes:
        try:
            if quote.doc not in docs:
                docs[quote.doc] = (root / quote.doc).read_text(encoding="utf-8")
            if quote.payload not in payloads:
                payloads[quote.payload] = load_payload(root / quote.payload)
        except (OSError, json.JSONDecodeError) as exc:
            problems.append(f"{quote.doc}: quote {quote.text!r}: {exc}")
            continue
        problems += check_quote(quote, docs[quote.doc], payloads[quote.payload])
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to check (default: this one)")
    ap.add_argument("--list", action="store_true", help="print every quote beside its payload's value")
    args = ap.parse_args(argv)
    if args.list:
        for quote in QUOTES:
            try:
                value = quote.expected(lookup(load_payload(args.root / quote.payload), quote.key))
            except (OSError, KeyError, TypeError, ValueError) as exc:
                value = f"? ({exc})"
            print(f"{quote.doc}: {quote.text!r} = {value}  <- {quote.where()}")
    problems = check(QUOTES, args.root)
    for problem in problems:
        print(problem, file=sys.stderr)
    summary = f"doc_numbers: {len(QUOTES)} quoted numbers in {len({q.doc for q in QUOTES})} documents"
    if problems:
        print(f"{summary}: {len(problems)} disagree with their payloads or are missing", file=sys.stderr)
    else:
        print(f"{summary} agree with their payloads", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
