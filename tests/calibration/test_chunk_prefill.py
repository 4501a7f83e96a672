"""The chunk prefill a server times at start: what new documents are priced at before any is served."""
from __future__ import annotations

import pytest

from cachesmith.calibration.chunk_prefill import time_chunk_prefills
from cachesmith.scheduler.feasibility import SheddingConfig
from tests.engine_helpers import save_tiny_chat_model
from tests.server.conftest import make_service

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-probe"))


def test_a_server_prices_new_documents_at_its_measured_pace_from_the_start(model_dir):
    service = make_service(model_dir)
    try:
        pricer = service.loop.deadlines.pricer
        timed = time_chunk_prefills(service.pipeline.model, num_tokens=64, num_timed=3)
        assert [n for n, _ in timed] == [64] * 3 and all(s > 0 for _, s in timed)
        # the start's probes replace the planner's pace with what ran
        assert pricer.prefill_pace != pytest.approx(pricer.planner.pace("position", 0, None))
    finally:
        service.close()
    off = make_service(model_dir, shedding=SheddingConfig(None))
    try:  # nothing to price with shedding off: no probe
        assert off.loop.deadlines.pricer.prefill_pace == pytest.approx(off.loop.deadlines.pricer.planner.pace(
            "position", 0, None))
    finally:
        off.close()
