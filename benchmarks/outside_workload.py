"""A workload from outside the suite, to check CacheSmith where nothing was tuned: two tasks the
profile, demand curves and outcome tables never saw, written as a workload file for
`cachesmith bench --workload`.

- `kv` (a lookup among look-alikes): 10 Wikipedia passages, each with one sentence "The badge
  number of <person> is <5 digits>." put in; the question asks one person's. Gold: the number.
- `describe`: 14 Wikipedia passages (title, then its extract); the question asks what one of
  them is. Gold: any word of 5+ letters of its short description (not in its title).

Requests alternate the two tasks; both are scored by "a gold answer occurs in the answer" (the
scorer of any task name outside the suite). The file is seeded (`--seed`), so runs compare.

    python -m benchmarks.outside_workload --out outside.jsonl
    cachesmith bench --workload outside.jsonl --pattern gamma --cv 2 --utilization 1.0 \\
        --slo-scale 2 --num-requests 32
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from cachesmith.workloads.corpus import load_corpus
from cachesmith.workloads.text import insert_sentence, person_names

NUM_KV_DOCS = 10
NUM_PASSAGES = 14


def kv_request(rng: random.Random, passages: list) -> dict:
    docs = [f"{p.title}\n{p.text}" for p in rng.sample(passages, NUM_KV_DOCS)]
    names = person_names(rng, NUM_KV_DOCS)
    values = [f"{rng.randrange(10 ** 4, 10 ** 5)}" for _ in names]
    docs = [insert_sentence(rng, d, f"The badge number of {k} is {v}.") for d, k, v in zip(docs, names, values)]
    j = rng.randrange(NUM_KV_DOCS)
    return {"task": "kv", "documents": docs, "question": f"What is the badge number of {names[j]}?",
            "gold": [values[j]], "answer_prefix": f"The badge number of {names[j]} is", "max_new_tokens": 10}


def describe_request(rng: random.Random, passages: list) -> dict:
    chosen = rng.sample(passages, NUM_PASSAGES)
    target = rng.choice(chosen)
    title_words = {w.lower() for w in target.title.split()}
    words = [w.strip(".,;:()\"'").lower() for w in target.description.split()]
    gold = sorted({w for w in words if len(w) >= 5 and w not in title_words})
    return {"task": "describe", "documents": [f"{p.title}\n{p.text}" for p in chosen],
            "question": f"In a few words, what is {target.title}?", "gold": gold,
            "answer_prefix": f"{target.title} is", "max_new_tokens": 16}


def outside_passages(corpus) -> list:
    """Passages of 30-120 words whose description has a 5+ letter word not in the title (else a
    title names its description, or a description is too short to point at one passage)."""
    return [p for p in corpus.passages if 30 <= len(p.text.split()) <= 120 and any(
        len(w) >= 5 and w.lower() not in p.title.lower() for w in p.description.split())]


def outside_requests(corpus, num_requests: int, seed: int) -> list[dict]:
    """The workload's lines, the two tasks in turn, seeded."""
    passages = outside_passages(corpus)
    rng = random.Random(seed)
    return [kv_request(rng, passages) if i % 2 == 0 else describe_request(rng, passages) for i in range(num_requests)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-instances", type=int, default=32)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    corpus = load_corpus()
    lines = outside_requests(corpus, args.num_instances, args.seed)
    args.out.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    print(f"{len(lines)} requests -> {args.out} (corpus: {corpus.source})")


if __name__ == "__main__":
    main()
