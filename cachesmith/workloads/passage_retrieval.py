"""PR, passage retrieval (LongBench PassageRetrieval-like): k real Wikipedia paragraphs, one per
chunk and labelled "Paragraph i"; the question identifies one of them without quoting it, and the
answer is "Paragraph i" (exact match on the number).

In: a corpus, a seed and knobs. Out: a `WorkloadInstance`. Variants: `description` (the paper's
form: the question gives the paragraph's Wikipedia short description, e.g. "Edible berry") and
`title` (names the subject, which the paragraph mentions: an easier lookup for small models).
"""
from __future__ import annotations

import random

from cachesmith.workloads.corpus import Corpus
from cachesmith.instance import WorkloadInstance
from cachesmith.workloads.text import TOKENS_PER_WORD, pick_passages

INSTRUCTION = ("You are given numbered paragraphs. Answer with the number of the paragraph that "
               "matches the question.")


def passage_retrieval(corpus: Corpus, seed: int, variant: str = "description", num_chunks: int = 6,
                      min_words: int = 40, max_words: int = 160) -> WorkloadInstance:
    rng = random.Random(seed)
    passages = pick_passages(rng, corpus, num_chunks, min_words, max_words)
    # balanced over consecutive seeds (and over MIX's every-4th seed): small models favour some
    # positions, and a skewed target draw would reward that bias
    target = (seed + seed // num_chunks) % num_chunks
    docs = tuple(f"Paragraph {i + 1}: {p.text.replace(chr(10), ' ')}" for i, p in enumerate(passages))
    subject = passages[target]
    if variant == "title":
        question = f"Which paragraph is about {subject.title}?"
        answer_prefix = f"The paragraph about {subject.title} is Paragraph"
    else:
        question = (f"Which paragraph is about the following: {subject.description[0].lower()}"
                    f"{subject.description[1:]}?")
        answer_prefix = "The answer is Paragraph"
    return WorkloadInstance(
        task="pr", variant=variant, documents=docs, question=question,
        gold=(f"Paragraph {target + 1}",), prefix=INSTRUCTION,
        answer_prefix=answer_prefix, max_new_tokens=4,
        metadata={"seed": seed, "num_chunks": num_chunks, "evidence_chunks": [target],
                  "titles": [p.title for p in passages],
                  "approx_tokens": int(sum(len(d.split()) for d in docs) * TOKENS_PER_WORD)},
    )
