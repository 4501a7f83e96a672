"""Dataset cards: a task's full-prefill and full-reuse accuracy and token lengths on one model.

In: a `RagPipeline` (model, dtype, device), a task/variant/knobs and a number of instances. Out: a
`DatasetCard`, written as markdown + JSON. The measurement is a long offline job: every
(instance, method) answer is appended to a JSONL cache keyed by model fingerprint and dtype, so an
interrupted run resumes where it stopped, and a progress bar shows how far it is.
"""
from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from cachesmith.instance import WorkloadInstance
from cachesmith.jsonl import load_keyed
from cachesmith.model.assets import cachesmith_home
from cachesmith.pipeline import Answer, RagPipeline
from cachesmith.recompute import RecomputeConfig, preset
from cachesmith.scoring import score
from cachesmith.workloads.corpus import Corpus, load_corpus
from cachesmith.workloads.tasks import TASKS, generate_many, resolve

BAR = 0.70  # the calibration target for full prefill
CAPABLE = 0.20  # below this the model cannot do the task at all
METHODS = ("full_prefill", "full_reuse")


def answer_instance(pipe: RagPipeline, inst: WorkloadInstance, plan: RecomputeConfig) -> Answer:
    return pipe.answer(inst.documents, inst.question, plan, inst.max_new_tokens, inst.answer_prefix,
                       inst.prefix or None)


@dataclass(frozen=True)
class DatasetCard:
    task: str
    variant: str
    n: int
    full_prefill_acc: float
    full_reuse_acc: float
    tokens_p50: int
    tokens_p90: int
    model: str = ""
    dtype: str = ""
    corpus: str = ""
    knobs: dict = field(default_factory=dict)
    full_prefill_ttft_s: float = 0.0  # mean single-request TTFT: the base SLO of the evaluation protocol
    full_reuse_ttft_s: float = 0.0
    reuse_fidelity: float = 0.0  # how often full reuse gives the full-prefill answer
    metric_means: dict = field(default_factory=dict)  # method -> mean task metric (F1, set F1, ...)
    note: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def to_markdown(self) -> str:
        desc = TASKS[self.task].description if self.task in TASKS else self.task
        rows = [("instances", self.n), ("full prefill accuracy", f"{self.full_prefill_acc:.0%}"),
                ("full reuse accuracy", f"{self.full_reuse_acc:.0%}"),
                ("full reuse agrees with full prefill", f"{self.reuse_fidelity:.0%}"),
                ("context tokens p50 / p90", f"{self.tokens_p50} / {self.tokens_p90}"),
                ("mean full-prefill TTFT", f"{self.full_prefill_ttft_s:.2f} s"),
                ("mean full-reuse TTFT", f"{self.full_reuse_ttft_s:.2f} s"),
                *((f"mean metric, {m}", f"{v:.3f}") for m, v in self.metric_means.items()),
                ("knobs", ", ".join(f"{k}={v}" for k, v in self.knobs.items()) or "defaults"),
                ("model / dtype", f"{self.model} / {self.dtype}"), ("corpus", self.corpus)]
        table = "\n".join(f"| {k} | {v} |" for k, v in rows)
        return (f"# Dataset card: {self.task} / {self.variant}\n\n{desc}.\n\n| field | value |\n|---|---|\n"
                f"{table}\n\n{self.note}\n")


def instance_digest(inst: WorkloadInstance) -> str:
    """Content hash: a changed generator never reuses answers cached for the old text."""
    return hashlib.sha256(inst.to_json().encode()).hexdigest()[:16]


def _dtype_name(pipe: RagPipeline) -> str:
    return str(pipe.model.dtype).removeprefix("torch.")


def _cache_path(pipe: RagPipeline, cache_dir: Path | None) -> Path:
    root = cache_dir or cachesmith_home() / "cards"
    root.mkdir(parents=True, exist_ok=True)
    return root / f"answers-{pipe.model.fingerprint[:16]}-{_dtype_name(pipe)}.jsonl"


def _note(task: str, variant: str, fp: float, fr: float) -> str:
    default = TASKS[task].default_variant if task in TASKS else variant
    closer = f" The closest variant it can do is `{task}/{default}`." if default != variant else ""
    if fp < CAPABLE:
        return f"**The model cannot do this variant** (full prefill {fp:.0%}).{closer}"
    if fp < BAR:
        return f"Full prefill is below the {BAR:.0%} calibration bar on this model.{closer}"
    return (f"Full prefill clears the {BAR:.0%} bar; full reuse passes {(fp - fr) * 100:.0f} points less."
            if fr < fp else
        "Full reuse does as well as full prefill: this variant does not need cross-chunk attention here.")


def measure_card(pipe: RagPipeline, task: str, variant: str | None = None, num_instances: int = 50,
                 seed: int = 0, knobs: dict | None = None, cache_dir: Path | None = None,
                 show_progress: bool = True, corpus: Corpus | None = None) -> DatasetCard:
    _, variant, variant_spec = resolve(task, variant)
    corpus = corpus or load_corpus()
    insts = generate_many(task, num_instances, seed, variant, corpus, **(knobs or {}))
    knobs = {**variant_spec.knobs, **(knobs or {})}
    path, L = _cache_path(pipe, cache_dir), pipe.model.num_layers
    done = load_keyed(path)
    records: dict[str, list[dict]] = {m: [] for m in METHODS}
    with path.open("a", encoding="utf-8") as out:
        for inst in tqdm(insts, desc=f"card {task}/{variant}", unit="inst", disable=not show_progress):
            for method in METHODS:
                key = f"{inst.name}/{instance_digest(inst)}/{method}"
                if key not in done:
                    plan = preset(method, 1.0 if method == "full_prefill" else 0.0, L)
                    ans = answer_instance(pipe, inst, plan)
                    done[key] = {"key": key, "answer": ans.text, "ttft_s": ans.ttft_s,
                                 "num_tokens": ans.num_context_tokens + ans.num_suffix_tokens}
                    out.write(json.dumps(done[key]) + "\n")
                    out.flush()
                rec = dict(done[key])
                s = score(inst, rec["answer"])
                rec.update(passed=s.passed, value=s.value, extracted=s.extracted, f1=s.f1)
                records[method].append(rec)
    return _card(pipe, task, variant, knobs, records, corpus.source)


def _card(pipe: RagPipeline, task: str, variant: str, knobs: dict, records: dict[str, list[dict]],
          corpus_source: str) -> DatasetCard:
    fp, fr = records["full_prefill"], records["full_reuse"]
    n = len(fp)
    tokens = sorted(r["num_tokens"] for r in fp)
    acc = {m: sum(r["passed"] for r in rs) / n for m, rs in records.items()}
    return DatasetCard(
        task=task, variant=variant, n=n, full_prefill_acc=acc["full_prefill"], full_reuse_acc=acc["full_reuse"],
        tokens_p50=int(statistics.median(tokens)), tokens_p90=tokens[min(n - 1, int(0.9 * n))],
        model=pipe.model.model_dir.name, dtype=_dtype_name(pipe), corpus=corpus_source,
        knobs=knobs, full_prefill_ttft_s=statistics.fmean(r["ttft_s"] for r in fp),
        full_reuse_ttft_s=statistics.fmean(r["ttft_s"] for r in fr),
        reuse_fidelity=sum(a["extracted"] == b["extracted"] for a, b in zip(fp, fr)) / n,
        metric_means={**{m: statistics.fmean(r["value"] for r in rs) for m, rs in records.items()},
                      **{f"{m} token F1": statistics.fmean(r["f1"] for r in rs)
                         for m, rs in records.items() if rs and rs[0]["f1"] is not None}},
        note=_note(task, variant, acc["full_prefill"], acc["full_reuse"]))


def write_card(card: DatasetCard, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{card.task}-{card.variant}"
    md, js = stem.with_suffix(".md"), stem.with_suffix(".json")
    md.write_text(card.to_markdown(), encoding="utf-8")
    js.write_text(card.to_json() + "\n", encoding="utf-8")
    return md, js
