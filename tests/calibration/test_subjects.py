"""What the profiler measures a plan on, as plain data: a served request is read by its keys, in its own
namespace; a workload instance by its token ids."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cachesmith.errors import InputError
from cachesmith.calibration.shadow import ServedSampler
from cachesmith.calibration.subjects import recompute_request, served_subject
from cachesmith.profiler.subjects import instance_subject
from cachesmith.request import Request
from cachesmith.scoring import Expected
from cachesmith.shadow_work import ShadowCalibrator, ShadowConfig
from cachesmith.workloads.prompts import instance_prompt
from tests.engine_helpers import instance, save_tiny_chat_model, tiny_pipeline

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

TENANT = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return tiny_pipeline(save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")), tmp_path_factory.mktemp("kv"))


def served(pipe, inst, namespace=TENANT) -> Request:
    prompt = pipe.stored_prompt(instance_prompt(pipe, inst), namespace)
    return Request(0, prompt, 5.0, inst.max_new_tokens, expected=Expected.of(inst))


def test_a_served_request_is_read_by_its_keys_in_its_own_namespace(pipe):
    inst = instance(21)
    req = served(pipe, inst)
    before = set(pipe.store.keys())
    got = recompute_request(pipe, served_subject(req), 4)
    assert set(pipe.store.keys()) == before  # nothing copied into another namespace
    offline = instance_subject(pipe, inst)
    want = recompute_request(pipe, offline, 4)  # the same texts, in the default namespace
    assert [c.token_ids for c in got.chunks] == [c.token_ids for c in want.chunks]
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(got.chunks, want.chunks))
    assert got.suffix_ids == want.suffix_ids and got.extra_capacity == 4
    subject = served_subject(req)
    assert subject.expected == offline.expected == Expected.of(inst) and subject.task == inst.task
    assert subject.max_new_tokens == offline.max_new_tokens == inst.max_new_tokens
    assert subject.digest != offline.digest and subject.digest == served_subject(served(pipe, inst)).digest
    assert served_subject(replace(req, max_new_tokens=1)).digest != subject.digest


def test_an_evicted_entry_is_rebuilt_from_its_source_and_one_without_is_skipped(pipe):
    inst = instance(22)
    req = served(pipe, inst)
    key = req.prompt.chunk_keys[0]
    pipe.store.delete(key)
    assert recompute_request(pipe, served_subject(req), 1).chunks[0].token_ids == req.prompt.chunks[0].token_ids
    assert pipe.store.contains(key)  # stored again, where its caller stored it
    pipe.store.delete(key)
    chunks = tuple(e._replace(token_ids=None) for e in req.prompt.chunks)
    sourceless = Request(1, replace(req.prompt, chunks=chunks), 5.0)
    with pytest.raises(InputError, match="no longer stored"):
        recompute_request(pipe, served_subject(sourceless), 1)


def test_shadow_work_skips_a_sample_whose_entries_are_gone():
    class Gone:
        def sample_rounds(self, request, keys):
            raise InputError("entry abc is no longer stored")
            yield

    samples = []
    shadow = ShadowCalibrator(Gone(), [("kv_dev", 2)], samples.append, ShadowConfig(fraction=1.0),
                              timer=lambda fn: (fn(), 0.1)[1])
    assert shadow.offer("a request") and shadow.run_idle(clock=None) == 1
    assert (shadow.stats.num_skipped, shadow.stats.num_samples, samples, shadow.has_work) == (1, 0, [], False)


def test_a_simulated_request_fails_inside_its_unit_and_is_skipped():
    """A request with no prompt cannot be measured: the sampler says so when its unit runs, so the
    calibrator counts it skipped instead of failing the serving loop that offered it."""
    class Profiler:
        def sample_rounds(self, subject, keys):
            raise AssertionError("never reached")

    rounds = ServedSampler(Profiler()).sample_rounds(Request(3, None, 5.0), [("kv_dev", 2)])  # nothing raised yet
    with pytest.raises(InputError, match="request 3: a simulated request has no prompt"):
        next(rounds)
    samples = []
    shadow = ShadowCalibrator(ServedSampler(Profiler()), [("kv_dev", 2)], samples.append, ShadowConfig(fraction=1.0),
                              timer=lambda fn: (fn(), 0.1)[1])
    assert shadow.offer(Request(4, None, 5.0)) and shadow.run_idle(clock=None) == 1
    assert (shadow.stats.num_skipped, samples) == (1, [])
