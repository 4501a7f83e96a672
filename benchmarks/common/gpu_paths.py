"""The GPU check's two path checks (benchmarks/gpu_check.py): graph decode's tokens against eager
decode's, and which SDPA kernel each of the engine's attention calls gets.

In: a loaded `Decoder` (and a `BatchRunner` over it), the check's context and token counts, and an
`SdpaRecorder` the phases run under. Out: row fields (dicts) for `check_rows.guarded`.
- `tokens_row`: distinct random prompts, prefilled once, decoded greedily twice from copies of
  their caches, by `Decoding(model, use_graphs=False)` and by `Decoding(model, use_graphs=True)`
  (CUDA graphs on a CUDA device; on the CPU both are eager): whether every token is equal, in the
  model's dtype. Where a stream differs: its first differing step and the logit gap there between
  the two tokens (a full prefill's logits, in units of their std). In half precision the two paths
  round differently (another attention kernel), and random weights leave near-ties among 49,152
  logits, so a step whose two tokens are within TIE_GAP passes; in float32 every token must match.
- `recompute_calls`: one CacheBlend@15% run, recorded.
- `SdpaRecorder`: a torch function mode noting the signature (shapes, strides, dtypes, mask, flags)
  of each `scaled_dot_product_attention` call while a phase is on; `kinds` groups them by all but
  their lengths. `kernel_row`: for every recorded signature of one kind, `device.sdpa_kernels` on
  fresh tensors of its shapes, strides, storage offsets and dtypes (the kernels' checks read no
  values): the kernels that take it and the one torch picks. It passes when no
  signature falls to the math kernel (None on the CPU, whose kernels are another set).
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from cachesmith.calibration.synthetic import random_request
from cachesmith.model import Decoder, Decoding
from cachesmith.model import device as accel
from cachesmith.recompute import BatchRunner, cacheblend

TIE_GAP = 0.1  # logits' std: a half-precision step whose two tokens are closer is a near-tie


# -- graph decode against eager decode ---------------------------------------------------------------
def decode_tokens(model: Decoder, firsts: list[tuple[torch.Tensor, object]], new_tokens: int,
                  use_graphs: bool) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prefilled prompt (`firsts`: its logits and cache, left untouched:
    copies are decoded), all streams stepped together; and how many steps replayed a graph."""
    decoding = Decoding(model, use_graphs=use_graphs)
    caches = [cache.clone() for _, cache in firsts]
    gens = [decoding.start(logits, cache, new_tokens, eos_token_ids=()) for (logits, _), cache in zip(firsts, caches)]
    decoding.run()
    replays = 0
    if decoding.graphs is not None:
        replays = decoding.graphs.num_replays
        decoding.graphs.release()  # the caches back in their own slabs, the bucket's memory freed
    for cache in caches:
        cache.release()
    return [gen.token_ids for gen in gens], replays


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tie_gap(model: Decoder, prompt: torch.Tensor, eager: list[int], graph: list[int], step: int) -> float:
    """|logit of eager's token - logit of graph's| at `step`, from a full prefill of the prompt and the
    tokens both chose before it, in units of those logits' std."""
    if step >= min(len(eager), len(graph)):
        return float("inf")  # one stopped early: no near-tie explains that
    ids = torch.cat([prompt, torch.tensor(eager[:step], dtype=prompt.dtype)])
    logits, cache = model.prefill(ids)
    cache.release()
    return ((logits[eager[step]] - logits[graph[step]]).abs() / logits.std()).item()


def tokens_row(model: Decoder, context: int, streams: int, new_tokens: int, recorder: SdpaRecorder) -> dict:
    """`streams` prompts of `context` tokens, decoded `new_tokens` each by both paths (recorded)."""
    prompts = [torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(20 + s))
               for s in range(streams)]
    with recorder.during("prefill"):
        firsts = [model.prefill(p, extra_capacity=new_tokens + 4) for p in prompts]
    with recorder.during("decode eager"):
        eager, _ = decode_tokens(model, firsts, new_tokens, use_graphs=False)
    with recorder.during("decode graph"):
        graph, replays = decode_tokens(model, firsts, new_tokens, use_graphs=True)
    for _, cache in firsts:
        cache.release()
    differ = {s: first_difference(e, g) for s, (e, g) in enumerate(zip(eager, graph)) if e != g}
    gaps = {s: tie_gap(model, prompts[s], eager[s], graph[s], step) for s, step in differ.items()}
    is_half = model.dtype in (torch.float16, torch.bfloat16)
    return {"context_tokens": context, "streams": streams, "new_tokens": new_tokens,
            "dtype": str(model.dtype).removeprefix("torch."), "graph_replays": replays,
            "tokens_equal": not differ, "first_difference": {str(s): step for s, step in differ.items()},
            "tie_gaps": {str(s): gap for s, gap in gaps.items()},
            "passed": not differ or (is_half and all(gap <= TIE_GAP for gap in gaps.values()))}


def recompute_calls(model: Decoder, runner: BatchRunner, context: int, recorder: SdpaRecorder) -> dict:
    """One CacheBlend@15% request of `context` tokens (chunk KV computed first, unrecorded), recorded."""
    req, _ = random_request(model, [], context, random.Random(context + 1))
    with recorder.during("recompute"):
        outs = runner.run([req], cacheblend(0.15))
    for out in outs:
        out.cache.release()
    return {"context_tokens": context, "calls": sum(recorder.calls.get("recompute", {}).values())}


# -- which SDPA kernel ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Operand:
    """What a kernel's checks read of a tensor: shape, strides, storage offset (the memory-efficient
    kernel checks the data pointer's alignment) and dtype."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> Operand:
        return Operand(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def fresh(self, device: torch.device) -> torch.Tensor:
        """A view of this signature into new memory (a fresh allocation: aligned as the caching
        allocator aligns a slab, so the offset gives the call's alignment)."""
        span = 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride) if n > 0)
        return torch.empty(self.offset + span, dtype=self.dtype, device=device).as_strided(
            self.shape, self.stride, self.offset)

    def label(self) -> str:
        """Its shape, the length (dim -2) as `*`: one kind of call over every length."""
        dims = [str(n) for n in self.shape]
        dims[-2] = "*"
        return f"[{','.join(dims)}]"


@dataclass(frozen=True)
class SdpaCall:
    """One `scaled_dot_product_attention` call's signature (dropout and scale: the engine's defaults)."""
    q: Operand
    k: Operand
    v: Operand
    mask: Operand | None
    is_causal: bool
    enable_gqa: bool

    @staticmethod
    def of(args: tuple, kwargs: dict) -> SdpaCall:
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        is_causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        return SdpaCall(Operand.of(q), Operand.of(k), Operand.of(v), None if mask is None else Operand.of(mask),
                        bool(is_causal), bool(kwargs.get("enable_gqa", False)))

    def kind(self) -> str:
        """Everything but the lengths: q and kv shapes, mask, causal, grouped heads."""
        flags = [name for name, on in (("mask", self.mask is not None), ("causal", self.is_causal),
                                       ("gqa", self.enable_gqa)) if on]
        return " ".join([f"q{self.q.label()}", f"kv{self.k.label()}", *flags])

    def fresh(self, device: torch.device) -> tuple:
        """Tensors of this signature on `device`, in `device.sdpa_kernels`' argument order."""
        mask = None if self.mask is None else self.mask.fresh(device)
        return self.q.fresh(device), self.k.fresh(device), self.v.fresh(device), mask, self.is_causal, self.enable_gqa


class SdpaRecorder(TorchFunctionMode):
    """Notes every `scaled_dot_product_attention` call made while a phase is on (`during`), and
    runs each call, and every other, unchanged (a mode sees the calls of every module, and those a
    CUDA graph captures, without touching the engine's code)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, dict[SdpaCall, int]] = {}  # phase -> signature -> calls, first seen first
        self._phase: str | None = None

    @contextmanager
    def during(self, phase: str) -> Iterator[None]:
        self._phase = phase
        try:
            with self:
                yield
        finally:
            self._phase = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "scaled_dot_product_attention" and self._phase is not None:
            seen = self.calls.setdefault(self._phase, {})
            call = SdpaCall.of(args, kwargs)
            seen[call] = seen.get(call, 0) + 1
        return func(*args, **kwargs)

    def kinds(self) -> dict[str, dict[SdpaCall, int]]:
        """`phase kind` -> its signatures and their call counts, in the order first seen."""
        out: dict[str, dict[SdpaCall, int]] = {}
        for phase, seen in self.calls.items():
            for call, count in seen.items():
                out.setdefault(f"{phase} {call.kind()}", {})[call] = count
        return out


def _span(lengths) -> list[int]:
    lengths = list(lengths)
    return [min(lengths), max(lengths)]


def kernel_row(calls: dict[SdpaCall, int], device: torch.device) -> dict:
    """Torch's kernels for every signature of one kind (`SdpaRecorder.kinds`): the kernels picked,
    and the flags and reasons of the first signature that fell to math (else of the first)."""
    first = next(iter(calls))
    answers = [accel.sdpa_kernels(*call.fresh(device)) for call in calls]
    row = {"dtype": str(first.q.dtype).removeprefix("torch."), "calls": sum(calls.values()),
           "signatures": len(calls), "q_lengths": _span(c.q.shape[-2] for c in calls),
           "key_lengths": _span(c.k.shape[-2] for c in calls),
           "mask_dtype": None if first.mask is None else str(first.mask.dtype).removeprefix("torch.")}
    if answers[0] is None:  # the CPU
        return {**row, "picked": None, "passed": None}
    shown = next((a for a in answers if a["picked"] == "math"), answers[0])
    picked = sorted({a["picked"] for a in answers})
    return {**row, "picked": picked, **{k: shown[k] for k in ("flash", "efficient", "cudnn", "reasons")},
            "passed": "math" not in picked}
