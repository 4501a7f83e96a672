"""The batch runner: executes a `(S, w, p, r)` plan layer by layer for heterogeneous requests.

In: a list of `RecomputeRequest` and one `RecomputeConfig` (shared S, w, p; per-request r).
Out: one `RecomputeOutput` per request: last-position logits, the assembled KV cache (ready for
greedy decoding), the recomputed context indices, scores and the layer-0 QCI entropy.

Linear parts run batched over every computed row of the batch; attention runs per request over
its mixed KV, causal by true position. Phases: WarmUp [0, w) computes everything;
Probe builds scores (qci / qci_last rewind to w afterwards; kv_dev probe layers are full layers, so
its Patch starts at w + p, see docs/adr/0014-recompute-semantics.md; fused ranks by both qci_last and
layer w's KV deviation, and rewinds to w); Patch recomputes selected rows + the suffix.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from cachesmith.model import Decoder
from cachesmith.model import device as accel
from cachesmith.recompute import signals, split_attention
from cachesmith.recompute.attention import ScatteredAttention, attention_probs
from cachesmith.errors import ConfigError
from cachesmith.recompute.config import RecomputeConfig, Signal, check_coverage
from cachesmith.recompute.hooks import LayerInfo, RunnerHooks
from cachesmith.recompute.fork import PatchFork
from cachesmith.recompute.graph_prefill import GraphPrefill
from cachesmith.recompute.query_probe import qci_last_scores, qci_scores
from cachesmith.recompute.run_state import PatchRows, Ranked, RecomputeOutput, num_cloned
from cachesmith.recompute.sequence import (RecomputeRequest, Sequence, build_sequence, fill_cached_rows,
                                           stitch_cached_rows)


# entropies after layer 0 -> (plan for the rest, per-request coverages or None)
Replan = Callable[[list[float | None]], tuple[RecomputeConfig, list[float | None] | None]]


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
        # on CUDA, plans the device can select for at a known size replay captured graphs
        # (`graph_prefill`) unless `model.is_prefill_graphed` is off; None on the CPU
        self.graphs = GraphPrefill(model) if accel.is_cuda(model.device) else None

    # -- public --------------------------------------------------------------------------------
    def run(self, requests: list[RecomputeRequest], config: RecomputeConfig,
            hooks: RunnerHooks | None = None, replan: Replan | None = None) -> list[RecomputeOutput]:
        """Run `config` over the batch. With `replan` (and warmup >= 1), the plan is decided after
        layer 0: `replan(entropies)` gets each request's layer-0 QCI entropy and returns the plan
        for the rest (warmup >= 1) and per-request coverages (None: the plan's), as the planner
        chooses the signal from them (paper §5.1)."""
        config.validate_for(self.model.num_layers)
        if (hooks is None and replan is None and self.graphs is not None and self.model.is_prefill_graphed
                and self.graphs.takes(requests, config)):
            outputs = self.graphs.run(requests, config)
            if outputs is not None:
                return outputs
        hooks = hooks or RunnerHooks()
        seqs = [build_sequence(self.model, r, config.coverage, i) for i, r in enumerate(requests)]
        with torch.inference_mode():
            if config.warmup < self.model.num_layers or replan is not None:  # cached KV will be read
                for s in seqs:
                    stitch_cached_rows(self.model, s)
            ranked = self._rank(seqs, config, hooks, replan)
            return ranked.outputs if ranked.outputs is not None else self.patch(ranked, hooks)

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
                branch = [replace(s, placed_layers=set(s.placed_layers), cache=s.cache.clone(num_cloned(s, layer)))
                          for s in seqs]
                forks[j] = PatchFork(self, self._after_warmup(configs[j], branch, h.clone(), hooks))
            if not is_to_end:
                return forks, []
            for layer in range(layer, num_layers):
                h, _ = self._full_layer(layer, seqs, h, hooks, "warmup", want_entropy=layer == 0)
            return forks, self._finish(seqs, h, [s.num_tokens for s in seqs])

    def _rank(self, seqs: list[Sequence], config: RecomputeConfig, hooks: RunnerHooks,
              replan: Replan | None) -> "Ranked":
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
                      hooks: RunnerHooks) -> "Ranked":
        """Probe after the WarmUp layers (`h`: the rows entering layer w)."""
        num_layers = self.model.num_layers
        if config.warmup >= num_layers:
            return Ranked(seqs, h, num_layers, None, self._finish(seqs, h, [s.num_tokens for s in seqs]))
        patch_start, h, start_kv = self._probe(config, seqs, h, hooks)
        if patch_start == num_layers:  # a kv_dev probe that reached the last layer: all full
            return Ranked(seqs, h, patch_start, None, self._finish(seqs, h, [s.num_tokens for s in seqs]))
        return Ranked(seqs, h, patch_start, start_kv)

    def patch(self, ranked: Ranked, hooks: RunnerHooks) -> list[RecomputeOutput]:
        """Selection at each request's coverage, then the Patch layers (a ranked batch's, or a fork's
        copies of one)."""
        seqs = ranked.seqs
        for s in seqs:
            s.selected = signals.select(s, s.coverage)
        hooks.after_selection([s.selected for s in seqs])
        rows = [self._patch_rows(s) for s in seqs]
        # rows in the all-rows layout, from the positions already on the device (no second copy)
        index = _joined([r.positions + a if a else r.positions for r, a in zip(rows, self._offsets(seqs))])
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
                      hooks: RunnerHooks, is_ranked: bool = True):
        """KV deviation scores (`s.scores`), ranked unless `is_ranked` is False (a caller that fuses
        them with another ranking reads them back itself)."""
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
            s.scores, s.ranking = sc, signals.rank(sc) if is_ranked else None
        return start, h, (x, k, v)

    def _fused_probe(self, config: RecomputeConfig, seqs: list[Sequence], h: torch.Tensor,
                     hooks: RunnerHooks):
        """The query's last-layer attention (rewinds to w), then KV deviation on layer w's
        projections (reused by Patch, as CacheBlend's), the two rankings fused (`signals.fuse`)."""
        qci = qci_last_scores(self.model, seqs, self._suffix_rows(seqs, h), config.warmup, hooks, self._after)
        start, h, start_kv = self._kv_dev_probe(replace(config, probe=0), seqs, h, hooks, is_ranked=False)
        for s, q in zip(seqs, qci):
            kv_scores, qci_scores = torch.stack([s.scores.float(), q.float()]).cpu()  # one read back
            s.scores, s.ranking = signals.fuse(kv_scores, qci_scores)
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

    def _patch_layer(self, index: int, seqs: list[Sequence], rows: list[PatchRows],
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
        index = torch.cat([torch.arange(a + s.suffix_start, a + s.num_tokens, device=h.device)
                           for s, a in zip(seqs, self._offsets(seqs))])  # built on the device: no copy
        return h[index]

    def _patch_rows(self, s: Sequence) -> PatchRows:
        positions = self._row_index(s, 0)
        dev = positions.to(self.model.device)
        cfg = self.model.config
        if self.num_attention_blocks is None and split_attention.is_available(self.model.device, self.model.dtype):
            attention = split_attention.SplitAttention(positions, s.num_suffix, cfg.num_heads, cfg.num_kv_heads)
        else:
            attention = ScatteredAttention(positions, self.model.device, self.model.dtype, s.num_suffix,
                                           self.num_attention_blocks, device_positions=dev)
        return PatchRows(dev, s.cos[dev], s.sin[dev], attention)

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


def _rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of `t`: `t` itself when that is all of it (one request), with no view op."""
    return t if a == 0 and b == t.shape[0] else t[a:b]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
