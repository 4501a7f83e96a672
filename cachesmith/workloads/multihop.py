"""MSQ, multi-hop QA (MuSiQue-like): a chain of facts about fictional people, one hop per chunk,
hidden among real Wikipedia passages and distractor facts of the same kinds; the question composes
the hops ("In which town was the mentor of the business partner of Alice Lantern born?").

In: a corpus, a seed and knobs. Out: a `WorkloadInstance` whose gold answer is a town name, scored
by normalized exact match (token F1 recorded). `num_hops=1` is a single fact among distractors.
"""
from __future__ import annotations

import random

from cachesmith.workloads.corpus import Corpus
from cachesmith.instance import WorkloadInstance
from cachesmith.workloads.text import filler, insert_sentence, person_names, place_names

# (phrase in the question, fact template) for person -> person hops
RELATIONS = (
    ("mentor", "{a} was trained for many years by {b}, who became {a}'s mentor."),
    ("business partner", "{a} founded a small shipping company together with {b}, {a}'s business partner."),
    ("neighbour", "{a} lived for a decade next door to {b}, {a}'s neighbour."),
    ("oldest friend", "{a}'s oldest friend is {b}; they met at school."),
)
BIRTH = "{a} was born in the town of {place}."


def _subject(relations: list[str], start: str) -> str:
    """"the mentor of the neighbour of Alice Lantern" for relations [neighbour, mentor]."""
    return "".join(f"the {r} of " for r in reversed(relations)) + start


def multi_hop(corpus: Corpus, seed: int, variant: str = "default", num_chunks: int = 8,
              num_hops: int = 2, num_distractors: int = 3, chunk_tokens: int = 200) -> WorkloadInstance:
    rng = random.Random(seed)
    docs = [filler(rng, corpus, chunk_tokens) for _ in range(num_chunks)]
    people = person_names(rng, num_hops + num_distractors)
    places = place_names(rng, 1 + num_distractors)
    chain = people[:num_hops]
    relations = [rng.choice(RELATIONS) for _ in range(num_hops - 1)]
    facts = [tpl.format(a=chain[i], b=chain[i + 1]) for i, (_, tpl) in enumerate(relations)]
    facts.append(BIRTH.format(a=chain[-1], place=places[0]))
    slots = rng.sample(range(num_chunks), num_hops)
    for slot, fact in zip(slots, facts):
        docs[slot] = insert_sentence(rng, docs[slot], fact)
    # distractors: each other person is born elsewhere, and some are linked to the chain's start by
    # another relation, so matching names alone does not find the answer
    for j, (person, place) in enumerate(zip(people[num_hops:], places[1:])):
        slot = rng.randrange(num_chunks)
        docs[slot] = insert_sentence(rng, docs[slot], BIRTH.format(a=person, place=place))
        if num_hops > 1 and j % 2 == 0:
            _, tpl = rng.choice([r for r in RELATIONS if r not in relations] or RELATIONS)
            other = rng.randrange(num_chunks)
            docs[other] = insert_sentence(rng, docs[other], tpl.format(a=chain[0], b=person))
    subject = _subject([r for r, _ in relations], chain[0])
    return WorkloadInstance(
        task="msq", variant=variant, documents=tuple(docs),
        question=f"In which town was {subject} born? Answer with the town's name only.",
        gold=(places[0],),
        prefix="Answer the question using the passages. Some facts are spread over several passages.",
        # restating the question opens the answer, so the town's name is the next thing to write
        answer_prefix=f"{subject[0].upper()}{subject[1:]} was born in the town of", max_new_tokens=6,
        metadata={"seed": seed, "num_chunks": num_chunks, "num_hops": num_hops,
                  "evidence_chunks": slots, "chain": chain, "distractor_places": places[1:]},
    )
