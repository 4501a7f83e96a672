"""Quality-gate verdicts of requests under many plans, measured together.

In: a `RagPipeline`, one or several `subjects.Subject`s (a workload's or a served request, as plain
data) and their trials, each a (plan, tag). Out: per trial a record
`{"key", "passed", "entropy", "text"}` (key = the subject's digest / tag), appended to a JSONL
cache, so a stopped run resumes where it was.

Offline searches over coverage (demand profiles, outcome tables) evaluate the same instance under
dozens of plans that differ only in their coverage. Plans sharing (S, w, p) are ranked once
(`BatchRunner.fork`, equal to separate runs bit for bit) and only their Patch phase runs per
coverage; every trial of one call, of every instance in it, is then decoded in one `Decoding`, so
the answers share each pass over the weights (a decoding step costs about the same for one
sequence as for dozens on a CPU: it reads every weight once). The chunks come from the store in memory (the staged path's identity with it is
tested), and each answer is read whole by the gate, as serving's is.
"""
from __future__ import annotations

import json
from pathlib import Path

from cachesmith.jsonl import load_keyed
from cachesmith.model.generate import Decoding
from cachesmith.pipeline import RagPipeline
from cachesmith.calibration.subjects import Subject, recompute_request
from cachesmith.recompute import PatchFork, RecomputeConfig, RecomputeOutput, RecomputeRequest, Signal
from cachesmith.scoring import score


class Verdicts:
    def __init__(self, pipe: RagPipeline, cache_path: Path | None, max_new_tokens: int = 1 << 30,
                 max_held: int = 4) -> None:
        """`cache_path` None keeps the records in memory only (shadow work: `forget` drops them)."""
        self.pipe = pipe
        self.cache_path = None if cache_path is None else Path(cache_path)
        if self.cache_path is not None:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        self.cache = {} if self.cache_path is None else load_keyed(self.cache_path)
        self.max_new_tokens = max_new_tokens
        # per instance digest, the forks holding its ranked state, for the `max_held` instances
        # used last (a fork holds a whole KV cache: memory stays that of a few requests)
        self._forks: dict[str, dict[tuple[Signal, int, int], PatchFork]] = {}
        self._requests: dict[str, RecomputeRequest] = {}  # the held instances' chunks, read once
        self.max_held = max_held

    def measure(self, inst: Subject, trials: list[tuple[RecomputeConfig, str]]) -> list[dict]:
        """The record of every trial, measuring the ones the cache lacks together."""
        return self.measure_many([(inst, trials)])[0]

    def measure_many(self, batch: list[tuple[Subject, list[tuple[RecomputeConfig, str]]]]) -> list[list[dict]]:
        """`measure` for several instances at once: their missing trials are decoded together, so
        the instances share each decoding pass over the weights."""
        digests = [inst.digest for inst, _ in batch]
        for d in digests:  # the most recently used last
            self._forks[d] = self._forks.pop(d, {})
        while len(self._forks) > max(self.max_held, len(set(digests))):
            oldest = next(iter(self._forks))
            del self._forks[oldest]
            self._requests.pop(oldest, None)
        missing = [(inst, d, plan, tag) for (inst, trials), d in zip(batch, digests) for plan, tag in trials
                   if f"{d}/{tag}" not in self.cache]
        if missing:
            self._measure(list({(m[1], m[3]): m for m in missing}.values()))  # a trial asked twice runs once
        return [[self.cache[f"{d}/{tag}"] for _, tag in trials] for (_, trials), d in zip(batch, digests)]

    def _measure(self, trials: list[tuple[Subject, str, RecomputeConfig, str]]) -> None:
        requests = {digest: self._requests.get(digest) or self._request(inst) for inst, digest, _, _ in trials}
        self._requests.update(requests)  # the chunks stay in hand while the instance's forks do
        fulls = self._fork_missing(trials, requests)
        outputs = self._prefill_all(trials, requests, fulls)
        decoding = Decoding(self.pipe.model)
        gens = [decoding.start(out.logits, out.cache, min(inst.max_new_tokens, self.max_new_tokens))
                for (inst, *_), out in zip(trials, outputs)]
        decoding.run()
        records = []
        for (inst, digest, _, tag), out, gen in zip(trials, outputs, gens):
            text = self.pipe.tokenizer.decode(gen.token_ids).strip()
            records.append({"key": f"{digest}/{tag}", "passed": score(inst.expected, text).passed,
                            "entropy": out.qci_entropy, "text": text})
            out.cache.release()
        self.cache.update((rec["key"], rec) for rec in records)
        if self.cache_path is not None:
            with self.cache_path.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(rec) + "\n" for rec in records)

    def forget(self, inst: Subject) -> None:
        """Drop one instance's records and forks (memory-only use)."""
        found = inst.digest
        self._forks.pop(found, None)
        self._requests.pop(found, None)
        for key in [k for k in self.cache if k.startswith(f"{found}/")]:
            del self.cache[key]

    def _request(self, inst: Subject) -> RecomputeRequest:
        return recompute_request(self.pipe, inst, min(inst.max_new_tokens, self.max_new_tokens))

    def _fork_missing(self, trials, requests: dict[str, RecomputeRequest]) -> dict[str, RecomputeOutput]:
        """Every fork this call's trials need and lack, per instance in one walk (`fork_many`: their
        WarmUp layers walked once), which also gives the instance's full prefill when a trial asks
        for it (`fork_with_full_prefill`). Returns those full prefills by instance digest."""
        num_layers = self.pipe.model.num_layers
        needed: dict[str, dict[tuple[Signal, int, int], RecomputeConfig]] = {}
        full_digests = set()
        for _, digest, plan, _ in trials:
            key = (plan.signal, plan.warmup, plan.probe)
            if plan.has_patch(num_layers) and key not in self._forks[digest]:
                needed.setdefault(digest, {})[key] = plan
            elif plan.warmup >= num_layers:
                full_digests.add(digest)
        fulls = {}
        for digest in sorted(set(needed) | full_digests):
            plans = needed.get(digest, {})
            if digest in full_digests:
                forks, outputs = self.pipe.runner.fork_with_full_prefill([requests[digest]], list(plans.values()))
                fulls[digest] = outputs[0]
            else:
                forks = self.pipe.runner.fork_many([requests[digest]], list(plans.values()))
            self._forks[digest].update(zip(plans, forks))
        return fulls

    def _prefill_all(self, trials, requests: dict[str, RecomputeRequest],
                     fulls: dict[str, RecomputeOutput]) -> list[RecomputeOutput]:
        """Each trial's prefill: full prefill from its instance's walk (`fulls`, once), other
        full-layer plans alone, Patch plans from their forks, one batch per (S, w, p) across the
        instances of this call (their rows share each layer's projections)."""
        num_layers = self.pipe.model.num_layers
        outputs: list[RecomputeOutput | None] = [None] * len(trials)
        groups: dict[tuple[Signal, int, int], list[int]] = {}
        for j, (_, digest, plan, _) in enumerate(trials):
            if plan.has_patch(num_layers):
                groups.setdefault((plan.signal, plan.warmup, plan.probe), []).append(j)
            elif plan.warmup >= num_layers and digest in fulls:
                outputs[j] = fulls.pop(digest)
            else:  # all full layers: nothing to share
                outputs[j] = self.pipe.runner.run([requests[digest]], plan)[0]
        for key, members in groups.items():
            forks = [self._forks[trials[j][1]][key] for j in members]
            runs = PatchFork.run_together(forks, [[trials[j][2].coverage] for j in members])
            for j, run in zip(members, runs):
                outputs[j] = run[0]
        return outputs
