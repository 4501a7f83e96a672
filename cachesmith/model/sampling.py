"""Choosing each next token from the model's logits: greedy or sampled, with OpenAI's penalties and
log-probabilities.

In: `SamplingParams` per request and, per step, the float32 logits `[vocab]` of the next position.
Out: the chosen token id and, when asked, its log-probability and the top alternatives'.

The order follows OpenAI's and vLLM's definitions: presence and frequency penalties subtract from
the logits of tokens already generated (presence once, frequency per occurrence), then temperature
divides, then top-k and top-p (nucleus) keep the smallest set of most likely tokens, then one is
drawn. Temperature 0 is greedy (argmax after penalties). Log-probabilities are the model's own
(log-softmax of the raw logits, before penalties and temperature), as vLLM reports them by default.
A request with a `seed` draws from its own generator seeded with it: the same request with the same
seed gives the same tokens.

Plain greedy rows (no penalties, no log-probabilities) of a batch are chosen together on the device
(`greedy_ids`: one argmax, nothing read back; `Decoding` copies the ids to the host once per step).
Every other row goes through its `Sampler` on its own, which reads values back (a host sync per row
on a GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cachesmith.errors import InputError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


GREEDY_BELOW = 1e-5  # a temperature under this samples greedily


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off (an extension to OpenAI's API, as in vLLM)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_logprobs: int | None = None  # None: no log-probabilities; k: the chosen token's and the top k

    def __post_init__(self) -> None:
        checks = [(0.0 <= self.temperature <= 2.0, "temperature", "must be between 0 and 2"),
                  (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
                  (self.top_k >= 0, "top_k", "must be >= 0 (0: off)"),
                  (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be between -2 and 2"),
                  (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be between -2 and 2"),
                  (self.num_logprobs is None or 0 <= self.num_logprobs <= MAX_TOP_LOGPROBS,
                   "top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}"),
                  (self.seed is None or -2**63 <= self.seed < 2**63, "seed", "must fit in 64 bits")]
        for is_ok, name, what in checks:
            if not is_ok:
                raise InputError(f"{name}={getattr(self, name, None)!r}: {what}")

    @property
    def is_greedy(self) -> bool:
        # below it, logits / temperature overflow float32 (5e-324 gives inf, then NaN probabilities):
        # such a temperature means the most likely token anyway (vLLM's threshold)
        return self.temperature < GREEDY_BELOW

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that needs the host (penalties, log-probabilities): such a row's token
        is the argmax of its logits, chosen on the device with the batch's (`greedy_ids`)."""
        return (self.is_greedy and self.num_logprobs is None
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0)


GREEDY = SamplingParams()


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


class Sampler:
    """The token choice of one sequence; keeps the counts the penalties need."""

    def __init__(self, params: SamplingParams = GREEDY) -> None:
        self.params = params
        self._counts: dict[int, int] = {}
        self._generator = None
        if not params.is_greedy:
            self._generator = torch.Generator()
            self._generator.manual_seed(params.seed if params.seed is not None
                                        else int(torch.randint(0, 2**62, (1,))))

    def choose(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """logits [vocab] (float32) -> (token id, its log-probability record or None)."""
        p = self.params
        scores = self._penalized(logits)
        if p.is_greedy:
            token = int(torch.argmax(scores))
        else:
            token = self._draw(scores / p.temperature)
        self.note(token)
        return token, (None if p.num_logprobs is None else _logprob(logits, token, p.num_logprobs))

    def note(self, token: int) -> None:
        """Count a token chosen for this sequence (by `choose`, or on the device by `greedy_ids`)."""
        self._counts[token] = self._counts.get(token, 0) + 1

    def _penalized(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if not self._counts or (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
            return logits
        ids = torch.tensor(list(self._counts), device=logits.device)
        counts = torch.tensor(list(self._counts.values()), dtype=logits.dtype, device=logits.device)
        out = logits.clone()
        out[ids] -= p.presence_penalty + p.frequency_penalty * counts
        return out

    def _draw(self, scores: torch.Tensor) -> int:
        p = self.params
        if p.top_k and p.top_k < scores.numel():
            kept, idx = torch.topk(scores, p.top_k)  # sorted, most likely first
        else:
            kept, idx = torch.sort(scores, descending=True)
        probs = torch.softmax(kept.float(), dim=-1).cpu()
        if p.top_p < 1.0:  # keep the smallest prefix whose mass reaches top_p (at least one token)
            before = torch.cumsum(probs, dim=-1) - probs
            is_kept = before < p.top_p
            is_kept[0] = True  # a top_p below float32's smallest number compares as 0 < 0
            probs = torch.where(is_kept, probs, torch.zeros_like(probs))
        choice = int(torch.multinomial(probs, 1, generator=self._generator))
        return int(idx[choice])


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [num_seqs, vocab] -> each row's most likely token id [num_seqs] (long), where the
    logits are: one call for the batch, and no value read back (ties: the lowest id, as `choose`)."""
    return torch.argmax(logits, dim=-1)


def _logprob(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = ()
    if num_top:
        values, ids = torch.topk(logprobs, num_top)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)
