"""The batch runner: executes a `(S, w, p, r)` plan layer by layer for heterogeneous requests.

In: a list of `RecomputeRequest` and one `RecomputeConfig` (shared S, w, p; per-request r).
Out: one `RecomputeOutput` per request: last-position logits, the assembled KV cache (ready for
greedy decoding), the recomputed context indices, scores and the layer-0 QCI entropy.

Linear parts run batched over every computed row of the batch; attention runs per request over
its mixed KV, causal by true position. Phases: WarmUp [0, w) computes everything;
Probe builds scores (qci / qci_last rewind to w afterwards; kv_dev probe layers are full layers, so
its Patch starts at w + p, see docs/decisions.md; fused ranks by both qci_last and layer w's KV
deviation, and rewinds to w); Patch recomputes selected rows + the suffix.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from cachesmith.model import Decoder, KVCache
from cachesmith.recompute import signals, split_attention
from cachesmith.recompute.attention import ScatteredAttention, attention_probs
from cachesmith.errors import ConfigError, InputError
from cachesmith.recompute.config import RecomputeConfig, Signal, check_coverage
from cachesmith.recompute.hooks import LayerInfo, RunnerHooks
from cachesmith.recompute.query_probe import qci_last_scores, qci_scores
from cachesmith.recompute.sequence import (RecomputeRequest, Sequence, build_sequence, fill_cached_rows,
                                           stitch_cached_rows)


# entropies after layer 0 -> (plan for the rest, per-request coverages or None)
Replan = Callable[[list[float | None]], tuple[RecomputeConfig, list[float | None] | None]]


@dataclass
class RecomputeOutput:
    logits: torch.Tensor  # [vocab] float32, last position
    cache: KVCache  # assembled KV of all S positions, ready for decoding
    selected: torch.Tensor  # context indices recomputed in the last Patch layer (CPU, sorted)
    scores: torch.Tensor | None  # [N] selection scores (None for warm-up-only plans)
    entropy: torch.Tensor | None  # 0-dim normalized entropy of layer-0 QCI scores (when w >= 1)
    num_context: int
    num_suffix: int

    @property
    def qci_entropy(self) -> float | None:
        """`entropy` as a float; read after the first token, when the device has caught up."""
        return None if self.entropy is None else float(self.entropy)

    @property
    def first_token(self) -> int:
        return int(torch.argmax(self.logits))


@dataclass
class _PatchRows:
    """Rows a request computes in Patch layers: selected context + suffix, sorted by position."""
    positions: torch.Tensor  # [num_rows] on the model device
    cos: torch.Tensor  # [num_rows, 1, head_dim]
    sin: torch.Tensor
    attention: ScatteredAttention | split_attention.SplitAttention


@dataclass
class _Ranked:
    """A batch after WarmUp and Probe: every request ranked, nothing selected yet."""
    seqs: list[Sequence]
    h: torch.Tensor  # [sum S, hidden] every row entering the first Patch layer
    patch_start: int
    start_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # kv_dev: normed rows, K, V of patch_start
    outputs: list[RecomputeOutput] | None = None  # set when no Patch layer is left


class BatchRunner:
    def __init__(self, model: Decoder, num_attention_blocks: int | None = None) -> None:
        """`num_attention_blocks`: query blocks per request in a Patch layer's attention (None:
        what was measured fastest for the device and dtype, `attention.default_num_blocks`; 1 is
        what a CUDA device runs: one masked call per request and layer)."""
        if num_attention_blocks is not None and num_attention_blocks < 1:
            raise ConfigError(f"num_attention_blocks={num_attention_blocks} must be >= 1 (or None)")
        self.model = model
        self.num_attention_blocks = num_attention_blocks
        self._split_heads = (model.config.num_heads, model.config.num_kv_heads)  # qk's heads: q | k
        cfg = model.config
        self._row_bytes = cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=model.dtype).element_size()

    # -- public --------------------------------------------------------------------------------
    def run(self, requests: list[RecomputeRequest], config: RecomputeConfig,
            hooks: RunnerHooks | None = None, replan: Replan | None = None) -> list[RecomputeOutput]:
        """Run `config` over the batch. With `replan` (and warmup >= 1), the plan is decided after
        layer 0: `replan(entropies)` gets each request's layer-0 QCI entropy and returns the plan
        for the rest (warmup >= 1) and per-request coverages (None: the plan's), as the planner
        chooses the signal from them (paper §5.1)."""
        config.validate_for(self.model.num_layers)
        hooks = hooks or RunnerHooks()
        seqs = [build_sequence(self.model, r, config.coverage, i) for i, r in enumerate(requests)]
        with torch.inference_mode():
            if config.warmup < self.model.num_layers or replan is not None:  # cached KV will be read
                for s in seqs:
                    stitch_cached_rows(self.model, s)
            ranked = self._rank(seqs, config, hooks, replan)
            return ranked.outputs if ranked.outputs is not None else self._patch(ranked, hooks)

    def fork(self, requests: list[RecomputeRequest], config: RecomputeConfig) -> "PatchFork":
        """The batch run through WarmUp and Probe once, ready to be patched at any coverages
        (`PatchFork.run`), each run equal to `run` at those coverages: the rankings do not depend
        on the coverage, so an offline search over coverages pays for them once."""
        return self.fork_many(requests, [config])[0]

    def fork_many(self, requests: list[RecomputeRequest], configs: list[RecomputeConfig]) -> list["PatchFork"]:
        """`fork` of several plans of one batch, their WarmUp layers walked once: a WarmUp layer
        computes every row exactly whatever the plan, so each plan branches off the shared walk
        where its WarmUp ends (a copy of the hidden rows and of the cache's layers so far) and
        equals its own `fork` bit for bit. A search over rank depths pays for the deepest WarmUp
        only."""
        return self._walk(requests, configs, is_to_end=False)[0]

    def fork_with_full_prefill(self, requests: list[RecomputeRequest], configs: list[RecomputeConfig]
                               ) -> tuple[list["PatchFork"], list[RecomputeOutput]]:
        """`fork_many` and the batch's full prefill from one walk: full prefill's layers are every
        plan's WarmUp layers, so the forks branch off it and it goes on to the last layer. Its
        outputs equal `run(requests, full_prefill)` bit for bit; an offline search that needs both
        (full prefill is the fidelity gate's reference) pays for the WarmUp layers once."""
        return self._walk(requests, configs, is_to_end=True)

    def _walk(self, requests: list[RecomputeRequest], configs: list[RecomputeConfig], is_to_end: bool
              ) -> tuple[list["PatchFork"], list[RecomputeOutput]]:
        num_layers = self.model.num_layers
        for config in configs:
            config.validate_for(num_layers)
            if not config.has_patch(num_layers):
                raise ConfigError(f"{config.label()} has no Patch phase to fork")
        seqs = [build_sequence(self.model, r, configs[0].coverage if configs else 1.0, i)
                for i, r in enumerate(requests)]
        forks: list[PatchFork | None] = [None] * len(configs)
        hooks = RunnerHooks()
        with torch.inference_mode():
            for s in seqs:
                stitch_cached_rows(self.model, s)
            h = torch.cat([self.model.embed(s.token_ids) for s in seqs])  # [sum S, hidden]
            layer = 0
            order = sorted(range(len(configs)), key=lambda i: configs[i].warmup)
            for n, j in enumerate(order, 1):
                while layer < configs[j].warmup:
                    h, _ = self._full_layer(layer, seqs, h, hooks, "warmup", want_entropy=layer == 0)
                    layer += 1
                if n == len(order) and not is_to_end:  # the deepest takes the walk itself
                    forks[j] = PatchFork(self, self._after_warmup(configs[j], seqs, h, hooks))
                    break
                branch = [replace(s, placed_layers=set(s.placed_layers), cache=s.cache.clone(_num_cloned(s, layer)))
                          for s in seqs]
                forks[j] = PatchFork(self, self._after_warmup(configs[j], branch, h.clone(), hooks))
            if not is_to_end:
                return forks, []
            for layer in range(layer, num_layers):
                h, _ = self._full_layer(layer, seqs, h, hooks, "warmup", want_entropy=layer == 0)
            return forks, self._finish(seqs, h, [s.num_tokens for s in seqs])

    def _rank(self, seqs: list[Sequence], config: RecomputeConfig, hooks: RunnerHooks,
              replan: Replan | None) -> "_Ranked":
        """Embedding, WarmUp and Probe: every request ranked, nothing selected yet (or the outputs,
        when no Patch layer is left)."""
        num_layers = self.model.num_layers
        h = torch.cat([self.model.embed(s.token_ids) for s in seqs])  # [sum S, hidden]
        layer = 0
        while layer < min(config.warmup, num_layers):  # a replan after layer 0 may change the warmup
            h, _ = self._full_layer(layer, seqs, h, hooks, "warmup", want_entropy=layer == 0)
            if layer == 0 and replan is not None:
                config = self._replan(replan, seqs, num_layers)
            layer += 1
        return self._after_warmup(config, seqs, h, hooks)

    def _after_warmup(self, config: RecomputeConfig, seqs: list[Sequence], h: torch.Tensor,
                      hooks: RunnerHooks) -> "_Ranked":
        """Probe after the WarmUp layers (`h`: the rows entering layer w)."""
        num_layers = self.model.num_layers
        if config.warmup >= num_layers:
            return _Ranked(seqs, h, num_layers, None, self._finish(seqs, h, [s.num_tokens for s in seqs]))
        patch_start, h, start_kv = self._probe(config, seqs, h, hooks)
        if patch_start == num_layers:  # a kv_dev probe that reached the last layer: all full
            return _Ranked(seqs, h, patch_start, None, self._finish(seqs, h, [s.num_tokens for s in seqs]))
        return _Ranked(seqs, h, patch_start, start_kv)

    def _patch(self, ranked: "_Ranked", hooks: RunnerHooks) -> list[RecomputeOutput]:
        """Selection at each request's coverage, then the Patch layers."""
        seqs = ranked.seqs
        for s in seqs:
            s.selected = signals.select(s, s.coverage)
        hooks.after_selection([s.selected for s in seqs])
        rows = [self._patch_rows(s) for s in seqs]
        index = torch.cat([self._row_index(s, a) for s, a in zip(seqs, self._offsets(seqs))]).to(ranked.h.device)
        h_sel = ranked.h[index]  # [sum (k_i + n_i), hidden]
        pre = None
        if ranked.start_kv is not None:  # kv_dev scored on the first Patch layer's K, V: reuse them
            x, k, v = ranked.start_kv
            pre = (self.model.layers[ranked.patch_start].q(x[index]), k[index], v[index])
        for layer in range(ranked.patch_start, self.model.num_layers):
            h_sel, rows = self._patch_layer(layer, seqs, rows, h_sel, hooks, pre if layer == ranked.patch_start else None)
        return self._finish(seqs, h_sel, [r.positions.numel() for r in rows])

    @staticmethod
    def _replan(replan: Replan, seqs: list[Sequence], num_layers: int) -> RecomputeConfig:
        # the one host read a planned run makes: the plan for the rest depends on these values
        config, coverages = replan([None if s.qci_entropy is None else float(s.qci_entropy) for s in seqs])
        config.validate_for(num_layers)
        if config.warmup < 1:
            raise ConfigError(f"a plan decided after layer 0 needs warmup >= 1, got {config.label()}")
        for i, s in enumerate(seqs):
            cov = coverages[i] if coverages is not None and coverages[i] is not None else config.coverage
            s.coverage = check_coverage(cov, f"requests[{i}].coverage")
        return config

    # -- phases --------------------------------------------------------------------------------
    def _probe(self, config: RecomputeConfig, seqs: list[Sequence], h: torch.Tensor,
               hooks: RunnerHooks):
        """Score and rank. Returns (first Patch layer, hidden rows, kv_dev's (normed rows, K, V) of
        that layer, all rows)."""
        if config.signal is Signal.KV_DEV:
            return self._kv_dev_probe(config, seqs, h, hooks)
        if config.signal is Signal.FUSED:
            return self._fused_probe(config, seqs, h, hooks)
        if config.signal is Signal.POSITION:  # selected from chunk bounds alone: nothing to rank
            for s in seqs:
                s.is_position_signal = True
            return config.warmup, h, None
        if config.signal is Signal.QCI:
            scores = qci_scores(self.model, seqs, self._suffix_rows(seqs, h),
                                range(config.warmup, config.warmup + config.probe), hooks, self._after)
        else:
            scores = qci_last_scores(self.model, seqs, self._suffix_rows(seqs, h), config.warmup, hooks, self._after)
        for s, sc in zip(seqs, scores):
            s.scores, s.ranking = sc, signals.rank(sc)
        return config.warmup, h, None

    def _kv_dev_probe(self, config: RecomputeConfig, seqs: list[Sequence], h: torch.Tensor,
                      hooks: RunnerHooks):
        scores = [torch.zeros(s.num_context, device=self.model.device) for s in seqs]
        start = config.warmup + config.probe
        for layer in range(config.warmup, start):
            h, devs = self._full_layer(layer, seqs, h, hooks, "probe", dev_target=config.kv_dev_target)
            scores = [a + b for a, b in zip(scores, devs)]
        if start == self.model.num_layers:
            return start, h, None
        hooks.before_layer(start, "patch")  # the scoring reads this Patch layer's cached KV
        layer = self.model.layers[start]
        x = layer.input_norm(h)
        k, v = layer.kv(x)  # all rows; the selected ones are reused in Patch
        for i, (s, a) in enumerate(zip(seqs, self._offsets(seqs))):
            scores[i] = scores[i] + self._deviation(s, start, k[a:a + s.num_tokens], v[a:a + s.num_tokens],
                                                    config.kv_dev_target, is_rotated=False)
        for s, sc in zip(seqs, scores):
            s.scores, s.ranking = sc, signals.rank(sc)
        return start, h, (x, k, v)

    def _fused_probe(self, config: RecomputeConfig, seqs: list[Sequence], h: torch.Tensor,
                     hooks: RunnerHooks):
        """The query's last-layer attention (rewinds to w), then KV deviation on layer w's
        projections (reused by Patch, as CacheBlend's), the two rankings fused (`signals.fuse`)."""
        qci = qci_last_scores(self.model, seqs, self._suffix_rows(seqs, h), config.warmup, hooks, self._after)
        start, h, start_kv = self._kv_dev_probe(replace(config, probe=0), seqs, h, hooks)
        for s, q in zip(seqs, qci):
            s.scores, s.ranking = signals.fuse(s.scores.cpu(), q.cpu())
        return start, h, start_kv

    def _full_layer(self, index: int, seqs: list[Sequence], h: torch.Tensor, hooks: RunnerHooks,
                    phase: str, want_entropy: bool = False, dev_target: str | None = None):
        """Every row of every request computed exactly (WarmUp, or a kv_dev Probe layer)."""
        hooks.before_layer(index, phase)
        layer, rope = self.model.layers[index], self.model.rope
        qk, v = layer.qk_v(layer.input_norm(h))  # qk [rows, H + Hkv, D]
        outs, devs, kv_rows = [], [], 0
        for s, a in zip(seqs, self._offsets(seqs)):
            b = a + s.num_tokens
            qi, ki = rope.apply(_rows(qk, a, b), s.cos, s.sin).split(self._split_heads, dim=1)
            if dev_target is not None:  # before the fresh rows overwrite the cached ones
                devs.append(self._deviation(s, index, ki, v[a:b], dev_target, is_rotated=True))
                kv_rows += s.num_context
            s.cache.write(index, 0, ki, v[a:b])
            keys, values = s.cache.view(index, s.num_tokens)  # contiguous V: faster SDPA
            outs.append(layer.attend(qi, keys, values, is_causal=True))
            if want_entropy:
                s.qci_entropy = self._entropy(s, qi, ki)
        h = layer.mlp_block(h.add_(layer.out_proj(_joined(outs))))
        self._after(hooks, index, phase, h.shape[0], kv_rows)
        return h, devs

    def _deviation(self, s: Sequence, index: int, k: torch.Tensor, v: torch.Tensor, target: str,
                   is_rotated: bool) -> torch.Tensor:
        """KV deviation of the context rows: fresh k, v [num_tokens, Hkv, D] of one request against
        its cached rows, compared rotated (RoPE keeps norms; staged rows are rotated in place)."""
        fill_cached_rows(self.model, s, index)
        ctx = slice(s.context_start, s.suffix_start)
        fresh_k = k[ctx] if is_rotated else self.model.rope.apply(k[ctx], s.cos[ctx], s.sin[ctx])
        return signals.kv_deviation(fresh_k, v[ctx], s.cache.keys[index][ctx], s.cache.values[index][ctx], target)

    def _entropy(self, s: Sequence, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(s.num_tokens, device=q.device)
        sfx = slice(s.suffix_start, s.num_tokens)
        probs = attention_probs(q[sfx], k, pos[sfx], pos)
        return signals.entropy_of(signals.qci_from_probs(probs, s))

    def _patch_layer(self, index: int, seqs: list[Sequence], rows: list[_PatchRows],
                     h_sel: torch.Tensor, hooks: RunnerHooks, pre=None):
        """Selected context rows + suffix rows recomputed over the mixed KV of the layer.
        With `pre` (kv_dev's projections) the layer's before-hook already ran during scoring."""
        if pre is None:
            hooks.before_layer(index, "patch")
        layer = self.model.layers[index]
        projected = pre if pre is not None else layer.qk_v(layer.input_norm(h_sel))
        outs, a, kv_rows = [], 0, 0
        for s, r in zip(seqs, rows):
            b = a + r.positions.numel()
            kv_rows += fill_cached_rows(self.model, s, index) - s.selected.numel()
            qi, ki, vi = self._rotated(projected, a, b, r.cos, r.sin)
            s.cache.keys[index].index_copy_(0, r.positions, ki)
            s.cache.values[index].index_copy_(0, r.positions, vi)
            keys, values = s.cache.view(index, s.num_tokens)
            outs.append(r.attention(layer, qi, keys, values))
            a = b
        h_sel = layer.mlp_block(h_sel.add_(layer.out_proj(_joined(outs))))
        lowered = self._after(hooks, index, "patch", h_sel.shape[0], kv_rows)
        if lowered:
            h_sel, rows = self._lower_coverage(seqs, rows, h_sel, lowered)
            hooks.after_selection([s.selected for s in seqs])
        return h_sel, rows

    def _lower_coverage(self, seqs, rows, h_sel, lowered: dict[int, float]):
        """Shrink selections (runtime monitor): dropped tokens keep cached KV in later layers."""
        keep, a = [], 0
        for i, (s, r) in enumerate(zip(seqs, rows)):
            n = r.positions.numel()
            if i in lowered and lowered[i] < s.coverage:
                old = s.selected
                s.coverage = lowered[i]
                s.selected = signals.select(s, s.coverage)
                mask = torch.isin(old, s.selected)
                keep.append(a + torch.cat([mask.nonzero().flatten(), torch.arange(old.numel(), n)]))
                rows[i] = self._patch_rows(s)
            else:
                keep.append(torch.arange(a, a + n))
            a += n
        return h_sel[torch.cat(keep).to(h_sel.device)], rows

    # -- helpers -------------------------------------------------------------------------------
    def _rotated(self, projected: tuple[torch.Tensor, ...], a: int, b: int, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [a, b) of a layer's projections, q and k rotated: `projected` is (qk, v) from
        `qk_v` (one rotation for both) or (q, k, v) (kv_dev's scoring projections)."""
        rope = self.model.rope
        if len(projected) == 2:
            qk, v = projected
            q, k = rope.apply(_rows(qk, a, b), cos, sin).split(self._split_heads, dim=1)  # [b - a, H | Hkv, D]
            return q, k, _rows(v, a, b)
        q, k, v = projected
        return rope.apply(_rows(q, a, b), cos, sin), rope.apply(_rows(k, a, b), cos, sin), _rows(v, a, b)

    def _after(self, hooks: RunnerHooks, layer: int, phase: str, num_rows: int, kv_rows: int):
        return hooks.after_layer(LayerInfo(layer, phase, num_rows, 2 * kv_rows * self._row_bytes))

    @staticmethod
    def _offsets(seqs: list[Sequence]) -> list[int]:
        out, a = [], 0
        for s in seqs:
            out.append(a)
            a += s.num_tokens
        return out

    @staticmethod
    def _row_index(s: Sequence, offset: int) -> torch.Tensor:
        """Rows (in the all-rows layout) of the selected context tokens and the suffix."""
        return offset + torch.cat([s.context_start + s.selected, torch.arange(s.suffix_start, s.num_tokens)])

    def _suffix_rows(self, seqs: list[Sequence], h: torch.Tensor) -> torch.Tensor:
        index = torch.cat([a + torch.arange(s.suffix_start, s.num_tokens)
                           for s, a in zip(seqs, self._offsets(seqs))])
        return h[index.to(h.device)]

    def _patch_rows(self, s: Sequence) -> _PatchRows:
        positions = self._row_index(s, 0)
        dev = positions.to(self.model.device)
        cfg = self.model.config
        if self.num_attention_blocks is None and split_attention.is_available(self.model.device, self.model.dtype):
            attention = split_attention.SplitAttention(positions, s.num_suffix, cfg.num_heads, cfg.num_kv_heads)
        else:
            attention = ScatteredAttention(positions, self.model.device, self.model.dtype, s.num_suffix,
                                           self.num_attention_blocks)
        return _PatchRows(dev, s.cos[dev], s.sin[dev], attention)

    def _finish(self, seqs: list[Sequence], h: torch.Tensor, rows_per_seq: list[int]):
        last, a = [], 0
        for n in rows_per_seq:
            a += n
            last.append(a - 1)
        logits = self.model.head(self.model.norm(h[last]))  # [num_requests, vocab]
        outputs = []
        for i, s in enumerate(seqs):
            s.cache.num_tokens = s.num_tokens
            selected = s.selected if s.selected is not None else torch.arange(s.num_context)
            outputs.append(RecomputeOutput(logits[i], s.cache, selected, s.scores, s.qci_entropy,
                                           s.num_context, s.num_suffix))
        return outputs


class PatchFork:
    """A ranked batch (`BatchRunner.fork`) patched at any coverages, as often as asked. Each run
    patches copies of the ranked state, so runs do not see each other: the first Patch layer's
    hidden rows and kv_dev's projections are only read, and each copy's cache holds the layers the
    ranking wrote (later layers are placed from the cached chunks as Patch reaches them)."""

    def __init__(self, runner: BatchRunner, ranked: _Ranked) -> None:
        self.runner, self.ranked = runner, ranked
        # [0, patch_start) hold WarmUp and Probe rows; a probe may also have placed later layers
        self._num_written = max([ranked.patch_start] + [i + 1 for s in ranked.seqs for i in s.placed_layers])

    def run(self, coverages: list[float]) -> list[RecomputeOutput]:
        """The batch's outputs with request i patched at `coverages[i]`."""
        return PatchFork.run_together([self], [coverages])[0]

    def _copies(self, coverages: list[float]) -> list[Sequence]:
        if len(coverages) != len(self.ranked.seqs):
            raise InputError(f"coverages: {len(coverages)} given for {len(self.ranked.seqs)} requests")
        return [replace(s, coverage=check_coverage(c, f"coverages[{i}]"), selected=None,
                        placed_layers=set(s.placed_layers), cache=s.cache.clone(_num_cloned(s, self._num_written)))
                for i, (s, c) in enumerate(zip(self.ranked.seqs, coverages))]

    @staticmethod
    def run_together(forks: list["PatchFork"], coverages: list[list[float]]) -> list[list[RecomputeOutput]]:
        """Several forks of one plan (e.g. of different requests) patched as one batch: their rows
        share each Patch layer's projections, as a served batch's do. Per fork, its outputs."""
        starts = {f.ranked.patch_start for f in forks}
        if len(starts) != 1 or len({f.runner for f in forks}) != 1:
            raise ConfigError(f"forks patched together need one runner and one first Patch layer, got {sorted(starts)}")
        seqs = [s for f, c in zip(forks, coverages) for s in f._copies(c)]
        kvs = [f.ranked.start_kv for f in forks]
        start_kv = None if kvs[0] is None else tuple(torch.cat(parts) for parts in zip(*kvs))
        ranked = _Ranked(seqs, torch.cat([f.ranked.h for f in forks]), starts.pop(), start_kv)
        with torch.inference_mode():
            outputs = forks[0].runner._patch(ranked, RunnerHooks())
        sizes = [len(f.ranked.seqs) for f in forks]
        return [outputs[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(forks))]


def _num_cloned(seq: Sequence, num_written: int) -> int | None:
    """Layers a copy of `seq`'s cache needs: those written so far, or all of them (None) when its
    chunks were stitched into every layer up front."""
    return None if seq.is_stitched else num_written


def _rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of `t`: `t` itself when that is all of it (one request), with no view op."""
    return t if a == 0 and b == t.shape[0] else t[a:b]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
