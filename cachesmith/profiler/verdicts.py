"""Quality-gate verdicts of one workload instance under many plans, measured together.

In: a `RagPipeline`, a `WorkloadInstance` and its trials, each a (plan, tag). Out: per trial a
record `{"key", "passed", "entropy", "text"}` (key = instance digest / tag), appended to a JSONL cache, so
a stopped run resumes where it was.

Offline searches over coverage (demand profiles, outcome tables) evaluate the same instance under
dozens of plans that differ only in their coverage. Plans sharing (S, w, p) are ranked once
(`BatchRunner.fork`, equal to separate runs bit for bit) and only their Patch phase runs per
coverage; every trial of one call is then decoded in one `Decoding`, so the answers share each pass
over the weights. The chunks come from the store in memory (the staged path's identity with it is
tested), and each answer is read whole by the gate, as serving's is.
"""
from __future__ import annotations

import json
from pathlib import Path

from cachesmith.jsonl import load_keyed
from cachesmith.model.generate import Decoding
from cachesmith.pipeline import RagPipeline
from cachesmith.recompute import PatchFork, RecomputeConfig, RecomputeOutput, RecomputeRequest, Signal
from cachesmith.workloads.card import instance_digest
from cachesmith.workloads.instance import WorkloadInstance
from cachesmith.workloads.scoring import score


class Verdicts:
    def __init__(self, pipe: RagPipeline, cache_path: Path, max_new_tokens: int = 1 << 30) -> None:
        self.pipe = pipe
        self.cache_path = Path(cache_path)
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        self.cache = load_keyed(self.cache_path)
        self.max_new_tokens = max_new_tokens
        self._digest: str | None = None  # the instance the forks below belong to
        self._forks: dict[tuple[Signal, int, int], PatchFork] = {}

    def measure(self, inst: WorkloadInstance, trials: list[tuple[RecomputeConfig, str]]) -> list[dict]:
        """The record of every trial, measuring the ones the cache lacks together."""
        digest = instance_digest(inst)
        missing = [(plan, tag) for plan, tag in trials if f"{digest}/{tag}" not in self.cache]
        if missing:
            self._measure(inst, digest, missing)
        return [self.cache[f"{digest}/{tag}"] for _, tag in trials]

    def _measure(self, inst: WorkloadInstance, digest: str, trials: list[tuple[RecomputeConfig, str]]) -> None:
        if digest != self._digest:  # one instance at a time: its forks hold its ranked state
            self._digest, self._forks = digest, {}
        max_new = min(inst.max_new_tokens, self.max_new_tokens)
        request = self._request(inst, max_new)
        outputs = [self._prefill(request, plan) for plan, _ in trials]
        decoding = Decoding(self.pipe.model)
        gens = [decoding.start(out.logits, out.cache, max_new) for out in outputs]
        decoding.run()
        with self.cache_path.open("a", encoding="utf-8") as f:
            for (plan, tag), out, gen in zip(trials, outputs, gens):
                text = self.pipe.tokenizer.decode(gen.token_ids).strip()
                rec = {"key": f"{digest}/{tag}", "passed": score(inst, text).passed, "entropy": out.qci_entropy,
                       "text": text}
                f.write(json.dumps(rec) + "\n")
                self.cache[rec["key"]] = rec
                out.cache.release()

    def _request(self, inst: WorkloadInstance, max_new: int) -> RecomputeRequest:
        parts = self.pipe.instance_prompt(inst)
        return RecomputeRequest([self.pipe.chunk(ids) for ids in parts.chunk_ids], parts.suffix_ids,
                                self.pipe.chunk(parts.prefix_ids) if parts.prefix_ids else None,
                                extra_capacity=max_new)

    def _prefill(self, request: RecomputeRequest, plan: RecomputeConfig) -> RecomputeOutput:
        runner = self.pipe.runner
        if not plan.has_patch(self.pipe.model.num_layers):  # all full layers: nothing to share
            return runner.run([request], plan)[0]
        key = (plan.signal, plan.warmup, plan.probe)
        if key not in self._forks:
            self._forks[key] = runner.fork([request], plan)
        return self._forks[key].run([plan.coverage])[0]
