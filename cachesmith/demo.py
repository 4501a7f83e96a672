"""`make demo`: the main job on the packaged model, as far as the pipeline exists today.

Precomputes the KV of eight passages, four of which hide a "special magic number" for different
keys, then asks for one key with full prefill, full reuse and the selective baselines, printing
TTFT relative to full prefill and each answer. The answer needs cross-chunk attention: under full
reuse the model tends to answer a distractor's number (DESIGN.md §4).
"""
from __future__ import annotations

import random

from cachesmith.pipeline import RagPipeline
from cachesmith.recompute import preset

PASSAGES = [
    "The river delta spreads across a wide plain where slow channels split and rejoin before they "
    "reach the sea. Farmers there plant rice in the wet season and beans in the dry months, and the "
    "floods that arrive every few years leave a layer of silt that keeps the fields fertile.",
    "Glaciers form where more snow falls in winter than melts in summer. Over centuries the snow is "
    "pressed into dense blue ice, which flows downhill under its own weight, carving valleys with "
    "steep walls and flat floors and leaving ridges of broken rock where it finally melts.",
    "A lighthouse keeper once had to trim the wick, polish the lens and wind the clockwork that turned "
    "the light, often through the whole night. Most lights are now automatic, and the old keepers' "
    "cottages have become museums, guest houses or homes for coastal researchers.",
    "Honeybees communicate the direction of flowers with a waggle dance. The angle of the dance on the "
    "comb shows the direction relative to the sun, and the length of the waggle run tells the other "
    "workers how far they must fly to reach the food.",
    "The printing press made books cheaper and faster to produce than copying by hand. Within a few "
    "decades, workshops in many cities were printing pamphlets, calendars and grammars, and reading "
    "spread well beyond monasteries and royal courts.",
    "Desert plants survive long droughts in different ways. Some store water in thick stems, some drop "
    "their leaves until rain returns, and some spend most of their lives as seeds that wait in the sand "
    "for a storm heavy enough to let them sprout, flower and seed again within weeks.",
    "Tides rise and fall twice a day on most coasts because the moon's gravity pulls the oceans into "
    "two bulges. When the sun and moon line up, the bulges add together and produce the large spring "
    "tides; at right angles they partly cancel and give the smaller neap tides.",
    "Early railway timetables forced towns to agree on a common time. Before that, each town kept its "
    "own local noon by the sun, so clocks in neighbouring cities could differ by several minutes, which "
    "made connecting trains surprisingly hard to schedule.",
]
KEYS = ["amber-falcon", "silent-meadow", "copper-lantern", "frozen-harbor"]
NEEDLE = "One of the special magic numbers for {key} is: {number}."


def build_instance(seed: int) -> tuple[list[str], str, str]:
    """Eight passages; four carry a needle each (distinct keys, 7-digit numbers); ask for one."""
    rng = random.Random(seed)
    docs = list(PASSAGES)
    rng.shuffle(docs)
    numbers = [str(rng.randrange(1_000_000, 10_000_000)) for _ in KEYS]
    slots = sorted(rng.sample(range(len(docs)), len(KEYS)))
    for slot, key, number in zip(slots, KEYS, numbers):
        docs[slot] = f"{docs[slot]} {NEEDLE.format(key=key, number=number)}"
    target = rng.randrange(len(KEYS))
    question = (f"What is the special magic number for {KEYS[target]} mentioned in the passages? "
                f"Answer with the number only.")
    return docs, question, numbers[target]


PLANS = [("full_prefill", 1.0), ("full_reuse", 0.0), ("cacheblend", 0.15), ("epic", 0.15),
         ("prophetkv", 0.15), ("fusionrag", 0.15)]


def main(model: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32",
         num_instances: int = 12) -> int:
    pipe = RagPipeline(model, device, dtype)
    num_layers = pipe.model.num_layers
    stats = {name: {"correct": 0, "ttft": 0.0, "recomputed": 0, "context": 0} for name, _ in PLANS}
    print(f"model {model} ({dtype}, {device}); {num_instances} instances of 8 passages, 4 needles each")
    for seed in range(num_instances):
        docs, question, gold = build_instance(seed)
        num_tokens, seconds = pipe.precompute(docs, question)
        if seed == 0:
            print(f"precomputed KV of {len(docs)} passages + prompt prefix: {num_tokens} tokens in "
                  f"{seconds:.2f} s ({num_tokens / seconds:.0f} tokens/s)")
            pipe.answer(docs, question, preset("full_reuse", 0.0, num_layers), max_new_tokens=1)
            print(f"example question: {question}  (gold {gold})")
        for name, coverage in PLANS:
            ans = pipe.answer(docs, question, preset(name, coverage, num_layers), max_new_tokens=32)
            st = stats[name]
            st["correct"] += gold in ans.text
            st["ttft"] += ans.ttft_s
            st["recomputed"] += ans.num_recomputed
            st["context"] += ans.num_context_tokens
            if seed == 0:
                print(f"  {name:<13} -> {ans.text[-48:]!r}")
    base = stats["full_prefill"]["ttft"]
    print(f"\n{'method':<13} {'plan':<22} {'recomputed':>10} {'TTFT s':>8} {'vs full':>8} {'accuracy':>9}")
    for name, coverage in PLANS:
        st = stats[name]
        print(f"{name:<13} {preset(name, coverage, num_layers).label():<22} "
              f"{st['recomputed'] / st['context']:>10.0%} {st['ttft'] / num_instances:>8.3f} "
              f"{st['ttft'] / base:>8.2f} {st['correct'] / num_instances:>9.0%}")
    return 0
