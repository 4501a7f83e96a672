"""Dataset cards on the packaged model: fields, markdown/JSON files, and resuming from the cache."""
from __future__ import annotations

import json

import pytest

from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.workloads.card import measure_card, write_card

pytestmark = pytest.mark.real_model
KNOBS = {"num_chunks": 3, "num_keys": 2, "chunk_tokens": 40}


@pytest.fixture(scope="module")
def pipe():
    return RagPipeline("smollm2-135m", store=ChunkStore(StoreConfig(tiers=("memory",))))


def test_card_measures_and_resumes(pipe, tmp_path, monkeypatch):
    card = measure_card(pipe, "vt", "kv-split", num_instances=3, knobs=KNOBS, cache_dir=tmp_path,
                        show_progress=False)
    assert card.task == "vt" and card.variant == "kv-split" and card.n == 3
    assert 0 <= card.full_reuse_acc <= 1 and 0 <= card.full_prefill_acc <= 1
    assert 100 < card.tokens_p50 <= card.tokens_p90 < 600
    assert card.full_prefill_ttft_s > 0 and card.knobs == KNOBS
    assert card.dtype == "float32" and "CC BY-SA" in card.corpus
    lines = (tmp_path / next(p.name for p in tmp_path.iterdir())).read_text().splitlines()
    assert len(lines) == 6  # 3 instances x 2 methods, one cached answer each

    def refuse(*args, **kwargs):
        raise AssertionError("a cached answer was computed again")

    monkeypatch.setattr(pipe, "answer", refuse)
    again = measure_card(pipe, "vt", "kv-split", num_instances=3, knobs=KNOBS, cache_dir=tmp_path,
                         show_progress=False)
    assert again == card
    md, js = write_card(card, tmp_path / "cards")
    data = json.loads(js.read_text())
    assert {"task", "variant", "n", "full_prefill_acc", "full_reuse_acc", "tokens_p50", "tokens_p90"} <= set(data)
    assert "# Dataset card: vt / kv-split" in md.read_text()
