"""transformers 4.x and 5.x side by side: the spellings that changed between them, chosen for the
installed one. The GPU check runs in a GPU machine's own Python, whose transformers may predate the
lock's (`make gpu-check` installs the kit's where it is outside pyproject's range, but a direct run
does not): an argument the installed version does not know is silently kept as a config attribute,
so a wrong spelling gives a different model rather than an error.

In: a RoPE base, a torch dtype, or a loaded transformers model. Out: keyword arguments for
transformers' config constructors, `from_pretrained` and a causal LM's forward.
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch

DTYPE_SINCE = (4, 56)  # `from_pretrained(dtype=)`; `torch_dtype=` before (and deprecated after)


def rope_kwargs(theta: float) -> dict:
    """Both spellings of a default RoPE's base, for a config's constructor. 5.x reads
    `rope_parameters` (and folds a `rope_theta` argument into it); 4.x reads `rope_theta` and keeps
    `rope_parameters` as a plain attribute, which our loader (`model.rope`) reads first: with one
    spelling alone, 4.x's model would run at its default base (10000) while ours runs at `theta`."""
    return {"rope_theta": float(theta), "rope_parameters": {"rope_type": "default", "rope_theta": float(theta)}}


@lru_cache(maxsize=1)
def transformers_version() -> tuple[int, int]:
    """(major, minor) of the installed transformers (ImportError where it is missing)."""
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def dtype_kwargs(dtype: torch.dtype) -> dict:
    """`from_pretrained`'s dtype argument: `dtype` from 4.56 on, `torch_dtype` before (where an
    unknown `dtype` would be ignored and the model loaded in float32)."""
    return {"dtype" if transformers_version() >= DTYPE_SINCE else "torch_dtype": dtype}


def last_logits_kwargs(model) -> dict:
    """The forward's argument that computes the last position's logits alone: `logits_to_keep`
    (4.50 on), `num_logits_to_keep` (4.45-4.49), else none (every position's; read the last)."""
    params = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}
