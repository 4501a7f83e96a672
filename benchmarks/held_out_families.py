"""Task families for the held-out protocol (`held_out_protocol.py`), written for it: no profile,
outcome table or benchmark of cachesmith has seen them, and they are not PR, MSQ, VT or MV, nor
`outside_workload.py`'s lookups.

- `bridge` (two hops across documents): 10 Wikipedia passages; three people get "<A>'s sister is
  <B>." in one passage and "<B> lives in <town>." in another. The question asks where one A's
  sister lives, so the answer needs a fact from each of two chunks. Gold: the town.
- `archive` (a fact bound to its document across a sentence): 10 passages, each gets "The archive
  number of this article is <5 digits>." somewhere in its text; the question asks one article's
  number by its title. Gold: the number.
- `continue` (finding a sentence and reading on): 10 passages; the question quotes the first six
  words of a sentence of one of them (named by its title) and asks how it goes on; the answer
  starts with those words. Gold: the sentence's next word (5+ letters).

All are scored by "a gold answer occurs in the answer" (the scorer of any task name outside the
suite). Lines are seeded, so runs compare. The protocol's default families are `archive` and
`continue`: on SmolLM2-135M full prefill answers `bridge` too rarely (4 of 24 held-out requests) for
any method to stand apart.

    python -m benchmarks.held_out_families --family bridge --num-instances 32 --out bridge.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from benchmarks.outside_workload import describe_request, kv_request, outside_passages

from cachesmith.workloads.corpus import load_corpus
from cachesmith.workloads.text import insert_sentence, person_names, place_names, split_sentences

NUM_DOCS = 10
NUM_CHAINS = 3
FRAGMENT_WORDS = 6


def _passages(corpus) -> list:
    return [p for p in corpus.passages if 30 <= len(p.text.split()) <= 120 and 2 <= len(p.title) <= 40]


def bridge_request(rng: random.Random, passages: list) -> dict:
    docs = [f"{p.title}\n{p.text}" for p in rng.sample(passages, NUM_DOCS)]
    people = person_names(rng, 2 * NUM_CHAINS)
    towns = place_names(rng, NUM_CHAINS)
    slots = rng.sample(range(NUM_DOCS), 2 * NUM_CHAINS)
    for c in range(NUM_CHAINS):
        a, b = people[2 * c], people[2 * c + 1]
        docs[slots[2 * c]] = insert_sentence(rng, docs[slots[2 * c]], f"{a}'s sister is {b}.")
        docs[slots[2 * c + 1]] = insert_sentence(rng, docs[slots[2 * c + 1]], f"{b} lives in {towns[c]}.")
    c = rng.randrange(NUM_CHAINS)
    a = people[2 * c]
    return {"task": "bridge", "documents": docs, "question": f"In which town does {a}'s sister live?",
            "gold": [towns[c]], "answer_prefix": f"{a}'s sister lives in", "max_new_tokens": 8}


def continue_request(rng: random.Random, passages: list) -> dict:
    chosen = rng.sample(passages, NUM_DOCS)
    docs = [f"{p.title}\n{p.text}" for p in chosen]
    for j in rng.sample(range(NUM_DOCS), NUM_DOCS):
        starts = [words for words in (s.split() for s in split_sentences(chosen[j].text))
                  if len(words) > FRAGMENT_WORDS and len(words[FRAGMENT_WORDS].strip(".,;:()\"'")) >= 5]
        if starts:
            words = rng.choice(starts)
            fragment = " ".join(words[:FRAGMENT_WORDS])
            return {"task": "continue", "documents": docs,
                    "question": f"In the article {chosen[j].title}, how does the sentence beginning "
                                f"\"{fragment}\" go on?",
                    "gold": [words[FRAGMENT_WORDS].strip(".,;:()\"'")], "answer_prefix": fragment,
                    "max_new_tokens": 6}
    return continue_request(rng, passages)  # no sentence long enough in any of them: draw again


def archive_request(rng: random.Random, passages: list) -> dict:
    chosen = rng.sample(passages, NUM_DOCS)
    numbers = [f"{rng.randrange(10 ** 4, 10 ** 5)}" for _ in chosen]
    docs = [insert_sentence(rng, f"{p.title}\n{p.text}", f"The archive number of this article is {n}.")
            for p, n in zip(chosen, numbers)]
    j = rng.randrange(NUM_DOCS)
    return {"task": "archive", "documents": docs, "question": f"What is the archive number of the article {chosen[j].title}?",
            "gold": [numbers[j]], "answer_prefix": f"The archive number of {chosen[j].title} is", "max_new_tokens": 8}


DEFAULT_FAMILIES = ("archive", "continue")
OUTSIDE = {"kv": kv_request, "describe": describe_request}  # outside_workload.py's two tasks
FAMILIES = {"archive": archive_request, "bridge": bridge_request, "continue": continue_request}


def family_requests(corpus, family: str, num_requests: int, seed: int) -> list[dict]:
    """`num_requests` seeded lines of one family (`kv` and `describe`: `outside_workload.py`'s)."""
    rng = random.Random(f"{family}/{seed}")
    if family in OUTSIDE:
        return [OUTSIDE[family](rng, outside_passages(corpus)) for _ in range(num_requests)]
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: must be one of {', '.join([*FAMILIES, *OUTSIDE])}")
    passages = _passages(corpus)
    return [FAMILIES[family](rng, passages) for _ in range(num_requests)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=sorted([*FAMILIES, *OUTSIDE]), required=True)
    ap.add_argument("--num-instances", type=int, default=32)
    ap.add_argument("--seed", type=int, default=2027)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    lines = family_requests(load_corpus(), args.family, args.num_instances, args.seed)
    args.out.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    print(f"{len(lines)} {args.family} requests -> {args.out}")


if __name__ == "__main__":
    main()
