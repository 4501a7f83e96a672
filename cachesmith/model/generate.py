"""Decoding from filled KV caches (after a full prefill or an assembled recompute), many sequences
stepped together.

In: per sequence the logits of its last prompt position, its cache, a token budget, `SamplingParams`
and an optional `on_token(index, token_id)` that hears each kept token as soon as it is chosen (a
server streams from it). Out: per sequence the generated token ids (stopping at an end-of-sequence
id, not included, or after `max_new_tokens`) and, when asked, their log-probabilities.

`start_generation` chooses a sequence's first token at once (it is the request's TTFT);
`Decoding` holds the sequences being decoded: `step` chooses everyone's next token in one
`decode_step`, and sequences join and leave between steps. The caller owns the caches (and releases them).

On a GPU a step must not wait for the device until its tokens are wanted on the host. `Decoding`
keeps each sequence's next input id and position on the device between steps (`_DeviceInputs`):
plain greedy rows are chosen there in one argmax that becomes the next step's input, and the
positions are incremented there. So a step after the first of a set of sequences copies nothing to
the device and reads nothing back while it runs, and its tokens come to the host once, in one copy
into a pinned buffer (`_TokenReader`). The inputs are rebuilt from the host (one copy) when
sequences join or leave, or when a row was chosen on the host: sampled rows, penalties and
log-probabilities still go through their own `Sampler`, one row at a time.

On CUDA (unless turned off: `Decoder.is_decode_graphed`, `serve --no-cuda-graphs`), a step whose
rows are all plain greedy and fit a batch bucket replays a captured CUDA graph instead
(`model.graph_decode`): its caches then live in a static slab, and move back to slabs of their own
before an eager step. The CPU path is the eager one, unchanged.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from cachesmith.errors import InputError
from cachesmith.model import device as accel
from cachesmith.model.decode import decode_step
from cachesmith.model.decoder import Decoder
from cachesmith.model.graph_decode import GraphDecoder
from cachesmith.model.kv_cache import KVCache
from cachesmith.model.sampling import GREEDY, Sampler, SamplingParams, TokenLogprob, greedy_ids


@dataclass(eq=False)
class Generation:
    """One sequence being decoded; `token_ids` and `logprobs` grow as it goes."""
    cache: KVCache
    max_new_tokens: int  # also bounded by the model's positions left after the prompt
    sampler: Sampler
    stop_ids: frozenset[int]
    on_token: Callable[[int, int], None] | None = None
    tag: object = None  # the caller's (e.g. which request this is)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    is_done: bool = False
    error: str | None = None  # set by a caller whose decode step failed
    prefilled: object = None  # an event after its cache was written, where another stream wrote it

    def take(self, logits: torch.Tensor) -> None:
        """Choose the next token from `logits` [vocab]; done at a stop id or when out of room."""
        self.keep(*self.sampler.choose(logits))

    def keep(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """The next token, chosen (`take`, or on the device for the whole batch): kept unless it is
        a stop id; done at a stop id or when out of room."""
        if token in self.stop_ids:
            self.is_done = True
            return
        self.token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.on_token is not None:
            self.on_token(len(self.token_ids) - 1, token)
        self.is_done = len(self.token_ids) >= self.max_new_tokens


def start_generation(model: Decoder, first_logits: torch.Tensor, cache: KVCache, max_new_tokens: int,
                     params: SamplingParams = GREEDY, on_token: Callable[[int, int], None] | None = None,
                     tag: object = None, eos_token_ids: Iterable[int] | None = None) -> Generation:
    """A sequence's generation with its first token chosen now (it is the request's TTFT)."""
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens={max_new_tokens} must be >= 0")
    stop = frozenset(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    # every kept token but the last takes a cache row
    limit = min(max_new_tokens, model.config.max_positions - cache.num_tokens)
    gen = Generation(cache, limit, Sampler(params), stop, on_token, tag)
    if limit <= 0:
        gen.is_done = True
    else:
        gen.take(first_logits)
    return gen


MIN_RELAYOUT_TOKENS = 4  # fewer tokens left: moving the cache costs more than its faster attention saves


def prepare_cache(gen: Generation) -> None:
    """Before a sequence's first decode step: its cache moves to the head-major layout with room for
    every token it may still add (no growth copies later), unless only a few are left. Moving costs
    about one copy of the cache (2K float32 tokens: a few ms); it runs where decoding runs, off the
    request's TTFT, and every later step's attention reads each head's keys contiguously."""
    cache = gen.cache
    if cache.is_head_major:
        return
    left = gen.max_new_tokens - len(gen.token_ids)
    if left >= MIN_RELAYOUT_TOKENS:
        cache.to_head_major(capacity=cache.num_tokens + left)


@dataclass(eq=False)
class _DeviceInputs:
    """The next step's inputs of one list of sequences, kept on the device between steps."""
    gens: list[Generation]  # in row order (a copy: `Decoding.active` is replaced or appended to)
    starts: list[int]  # each cache's num_tokens before the step: the host knows them without a read
    token_ids: torch.Tensor  # [num_seqs] long, device: each sequence's last kept token
    positions: torch.Tensor  # [num_seqs] long, device: `starts` there
    is_plain_greedy: list[bool]  # per row: chosen on the device (`SamplingParams.is_plain_greedy`)

    def is_for(self, gens: list[Generation]) -> bool:
        """Whether these are still the inputs of `gens` (same rows, caches where they were left)."""
        return self.gens == gens and self.starts == [g.cache.num_tokens for g in gens]


MIN_PINNED_IDS = 64  # the largest batch-size bucket: one pinned buffer serves every usual batch


class _TokenReader:
    """Each step's device-chosen ids to the host: on a GPU one asynchronous copy into a pinned
    buffer (kept across steps: pinning memory is slow) and one wait on its event; on the CPU the ids
    are host memory already."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None  # [capacity] long

    def read(self, ids: torch.Tensor) -> list[int]:
        """ids [num_seqs] long -> their values."""
        if not accel.is_cuda(self.device):
            return ids.tolist()
        n = ids.numel()
        if self._pinned is None or self._pinned.numel() < n:
            with torch.inference_mode(False):  # steps outside inference mode write it too
                self._pinned = accel.pinned_empty((max(n, MIN_PINNED_IDS),), torch.long, is_pinned=True)
        host = self._pinned[:n]
        host.copy_(ids, non_blocking=True)
        done = accel.new_event(self.device)
        done.record()
        done.synchronize()  # the step's one wait: its tokens decide who goes on
        return host.tolist()


class Decoding:
    """The sequences being decoded together on one model."""

    def __init__(self, model: Decoder, use_graphs: bool | None = None) -> None:
        """`use_graphs`: plain-greedy steps on CUDA replay captured graphs (default: the model's
        `is_decode_graphed`); inert on the CPU."""
        self.model = model
        self.active: list[Generation] = []
        self._inputs: _DeviceInputs | None = None  # the next step's, while they still hold
        self._reader = _TokenReader(model.device)
        use_graphs = model.is_decode_graphed if use_graphs is None else use_graphs
        self.graphs = GraphDecoder(model, model.max_graph_bytes) if use_graphs and accel.is_cuda(model.device) \
            else None

    def start(self, first_logits: torch.Tensor, cache: KVCache, max_new_tokens: int, **kwargs) -> Generation:
        """`start_generation` on this model, joined to the next step unless already done."""
        gen = start_generation(self.model, first_logits, cache, max_new_tokens, **kwargs)
        self.add(gen)
        return gen

    def add(self, gen: Generation) -> None:
        """Join a generation started elsewhere (e.g. on the prefill thread and stream) to the next
        step: the decode stream waits, on the device, for the stream that wrote its cache."""
        if gen.prefilled is not None:
            accel.current_stream(self.model.device).wait_event(gen.prefilled)
            gen.prefilled = None
        if not gen.is_done:
            self.active.append(gen)

    def step(self) -> list[Generation]:
        """One decode step over every active sequence; returns those that finished in it."""
        if not self.active:
            return []
        gens = self.active
        if self.graphs is not None:
            tokens = self.graphs.step(gens, self._reader.read) if self.graphs.takes(gens) else None
            if tokens is not None:
                return self._graph_step(gens, tokens)
            self.graphs.release()  # eager steps read and grow the caches: back in their own slabs
        for gen in gens:
            prepare_cache(gen)
        inputs = self._inputs_of(gens)
        logits, greedy = self._launch(inputs)
        chosen = self._reader.read(greedy) if greedy is not None else None
        for j, gen in enumerate(gens):
            if inputs.is_plain_greedy[j]:
                gen.sampler.note(chosen[j])
                gen.keep(chosen[j])
            else:  # logits[j]: [vocab], on the device; its sampler reads values back
                gen.take(logits[j])
                self._inputs = None  # the device holds no id for this row: the host's, next step
        return self._settle(gens)

    def _graph_step(self, gens: list[Generation], tokens: list[int]) -> list[Generation]:
        """The step replayed from a captured graph (every row plain greedy): its tokens kept."""
        self._inputs = None  # the eager inputs no longer hold: the caches moved on
        for gen, token in zip(gens, tokens):
            gen.sampler.note(token)
            gen.keep(token)
        return self._settle(gens)

    def _settle(self, gens: list[Generation]) -> list[Generation]:
        """Drop the finished sequences from the active ones, and return them."""
        self.active = [g for g in gens if not g.is_done]
        return [g for g in gens if g.is_done]

    @torch.inference_mode()
    def _inputs_of(self, gens: list[Generation]) -> _DeviceInputs:
        """The device inputs of `gens`: the last step's, advanced on the device, while they hold;
        else built from the host in one copy (sequences joined or left, or a row was chosen on the host)."""
        if self._inputs is not None and self._inputs.is_for(gens):
            return self._inputs
        starts = [g.cache.num_tokens for g in gens]
        both = torch.tensor([[g.token_ids[-1] for g in gens], starts], device=self.model.device)  # [2, num_seqs]
        self._inputs = _DeviceInputs(list(gens), starts, both[0], both[1],
                                     [g.sampler.params.is_plain_greedy for g in gens])
        return self._inputs

    @torch.inference_mode()
    def _launch(self, inputs: _DeviceInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's device work: logits [num_seqs, vocab], and each row's greedy id [num_seqs]
        (None if no row is plain greedy), which is also the next step's input. Nothing in it reads
        a value back from the device or copies one to it."""
        logits = decode_step(self.model, inputs.token_ids, [g.cache for g in inputs.gens], inputs.positions)
        inputs.starts = [start + 1 for start in inputs.starts]
        inputs.positions.add_(1)
        if not any(inputs.is_plain_greedy):
            return logits, None
        greedy = greedy_ids(logits)
        inputs.token_ids.copy_(greedy)  # in place: the next step reads the same buffer
        return logits, greedy

    def run(self) -> None:
        """Step until every sequence is done."""
        while self.active:
            self.step()


def greedy_decode(model: Decoder, first_logits: torch.Tensor, cache: KVCache, max_new_tokens: int,
                  eos_token_ids: Iterable[int] | None = None,
                  on_token: Callable[[int, int], None] | None = None) -> list[int]:
    """Greedy token ids of one sequence (see `Decoding` for many)."""
    decoding = Decoding(model)
    gen = decoding.start(first_logits, cache, max_new_tokens, on_token=on_token, eos_token_ids=eos_token_ids)
    decoding.run()
    return gen.token_ids
