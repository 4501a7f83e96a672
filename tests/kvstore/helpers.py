"""Shared builders for store and transfer tests."""
from __future__ import annotations

from cachesmith.kvstore import put_prompt
from tests.recompute.helpers import make_request


def stored_requests(model, store, seeds=(1, 2)):
    """Per seed, a request of three chunks and a prefix, in memory and as stored keys."""
    reqs, keyed = [], []
    for seed in seeds:
        req, _ = make_request(model, seed=seed, chunk_lens=(70, 40, 30))
        reqs.append(req)
        keyed.append(put_prompt(store, req.chunks, req.suffix_ids, req.prefix))
    return reqs, keyed
