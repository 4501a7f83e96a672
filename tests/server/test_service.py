"""The Python API under the server: documents as texts or stored ids, limits, pins, listing."""
from __future__ import annotations

import pytest

from cachesmith.engine import EngineConfig
from cachesmith.queue_places import EngineClosed
from cachesmith.errors import ConfigError, InputError
from cachesmith.kvstore import ChunkStore, StoreConfig
from cachesmith.pipeline import RagPipeline
from cachesmith.recompute import full_prefill
from cachesmith.server import CompletionSpec, DocumentRef, ServiceConfig
from tests.engine_helpers import save_tiny_chat_model
from tests.server.conftest import make_service

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

DOCS = ("river glacier lantern harbor meadow falcon", "copper amber silent frozen canyon velvet")
QUESTION = "Which word comes after river?"


@pytest.fixture()
def service(tiny_chat_dir, tmp_path):
    svc = make_service(tiny_chat_dir, tmp_path / "kv", ("memory", "disk"),
                       engine=EngineConfig("full_prefill", "live"))
    yield svc
    svc.close(10)


def spec(docs, **kw) -> CompletionSpec:
    return CompletionSpec(tuple(docs), QUESTION, **{"max_tokens": 6, **kw})


def test_texts_ids_and_a_mix_serve_the_same_prompt_as_the_pipeline(service):
    pipe = service.pipeline
    want = pipe.answer(list(DOCS), QUESTION, full_prefill(pipe.model.num_layers), max_new_tokens=6)
    ids = [r.chunk_id for r in service.add_chunks(DOCS)]
    variants = [[DocumentRef(text=d) for d in DOCS], [DocumentRef(chunk_id=i) for i in ids],
                [DocumentRef(chunk_id=ids[0]), DocumentRef(text=DOCS[1])]]
    for docs in variants:
        tokens: list[tuple[int, int]] = []
        res = service.submit(spec(docs), on_token=lambda i, t: tokens.append((i, t))).result(timeout=60)
        assert res.error is None and res.answer == want.text
        assert [i for i, _ in tokens] == list(range(len(tokens))) and [t for _, t in tokens] == want.token_ids
        assert res.num_prompt_tokens == len(pipe.prompt(list(DOCS), QUESTION).token_ids)
    assert not service.chunks._pins  # every pin released


@pytest.mark.parametrize("bad, words", [
    (dict(docs=[DocumentRef(text="a")] * 65), "limit of 64"),
    (dict(docs=[DocumentRef(text="a", chunk_id="0" * 64)]), "exactly one"),
    (dict(docs=[DocumentRef(text="a")], max_tokens=0), "max_tokens=0"),
    (dict(docs=[DocumentRef(text="a")], slo_s=float("nan")), "slo_ms=nan"),
    (dict(docs=[DocumentRef(text="a")], slo_s=7200.0), "at most 3600000"),
])
def test_bad_specs_are_refused_by_field(service, bad, words):
    docs = bad.pop("docs")
    with pytest.raises(InputError, match=words.replace("+", r"\+")):
        service.submit(spec(docs, **bad))
    assert service.num_rejected["invalid"] == 1 and not service.chunks._pins


def test_listeners_hear_results_and_close_drains(service):
    heard = []
    service.listeners.append(heard.append)
    futures = [service.submit(spec([DocumentRef(text=f"{d} {i}") for d in DOCS])) for i in range(4)]
    assert service.close(60)
    assert all(f.done() and f.result().error is None for f in futures)
    assert sorted(r.request_id for r in heard) == sorted(f.result().request_id for f in futures)
    with pytest.raises(EngineClosed):
        service.submit(spec([DocumentRef(text="late")]))
    assert service.num_rejected["closed"] == 1


def test_listing_skips_and_keeps_another_models_chunks(service, tmp_path):
    other_dir = save_tiny_chat_model(tmp_path / "other", seed=1)
    store = ChunkStore(StoreConfig(tiers=("disk",), root=tmp_path / "kv"))
    other = RagPipeline(str(other_dir), store=store)
    assert other.model.fingerprint != service.pipeline.model.fingerprint
    foreign, _ = store.ensure(other.model, other.tokenizer.chunk_ids("a foreign passage"))
    mine = service.add_chunks(["my passage"])[0].chunk_id
    listed = [r.chunk_id for r in service.list_chunks()[0]]
    assert mine in listed and foreign not in listed
    assert service.chunk(foreign) is None and not service.delete_chunk(foreign)
    assert store.contains(foreign)  # listing never evicts another model's entry
    with pytest.raises(InputError, match="limit=0"):
        service.list_chunks(limit=0)


def test_service_config_is_validated():
    with pytest.raises(ConfigError, match="live clock"):
        ServiceConfig(engine=EngineConfig(clock="replay"))
    with pytest.raises(ConfigError, match="max_queue"):
        ServiceConfig(max_queue=0)
    with pytest.raises(ConfigError, match="default_max_tokens"):
        ServiceConfig(default_max_tokens=600)



def test_answer_prefix_is_continued_as_in_the_pipeline(service):
    pipe = service.pipeline
    want = pipe.answer(list(DOCS), QUESTION, full_prefill(pipe.model.num_layers), 6, answer_prefix="The word is")
    tokens: list[int] = []
    res = service.submit(spec([DocumentRef(text=d) for d in DOCS], answer_prefix="The word is"),
                         on_token=lambda i, t: tokens.append(t)).result(timeout=60)
    assert res.error is None and tokens == want.token_ids
    plain = service.submit(spec([DocumentRef(text=d) for d in DOCS])).result(timeout=60)
    assert res.num_prompt_tokens > plain.num_prompt_tokens


def test_a_prompt_past_the_window_is_refused_before_its_chunks_are_prefilled(service):
    """Documents that fit the 1,024 positions alone but not with the rest of the prompt and
    max_tokens: refused naming the documents, and none of them prefilled or stored."""
    pipe = service.pipeline
    texts = [" ".join(["lantern harbor meadow"] * 120), " ".join(["copper amber falcon"] * 120)]
    num_context = sum(len(pipe.tokenizer.chunk_ids(t)) for t in texts)
    num_prefix, num_suffix = pipe.tokenizer.frame_lengths(QUESTION, pipe.system)
    num_prompt = num_prefix + num_context + num_suffix
    max_tokens = 1024 - num_prompt + 1  # one token past the window
    assert 0 < max_tokens and num_context < 1024
    docs = [DocumentRef(text=t) for t in texts]
    with pytest.raises(InputError, match=rf"^documents: the prompt's {num_prompt} tokens \+ max_tokens "
                                         rf"{max_tokens} exceed the model's 1024 positions"):
        service.submit(spec(docs, max_tokens=max_tokens))
    assert service.store.keys() == [] and not service.chunks._pins
    res = service.submit(spec(docs, max_tokens=max_tokens - 1)).result(timeout=60)  # fits exactly
    assert res.error is None and res.num_prompt_tokens == num_prompt
    with pytest.raises(InputError, match=r"^prompt: the prompt's"):  # no documents: the prompt is at fault
        service.submit(CompletionSpec((), " ".join(["river"] * 1100), max_tokens=4))


def test_each_admission_stores_its_documents_and_joins_the_queue_in_one_turn(service):
    """A burst's admissions, each with new documents, end one after another: no request's document
    prefill falls between another's first prefill and its joining the queue (with one lock turn a
    document, they interleaved and all ended together, each far past its price)."""
    import itertools
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    events: list[tuple[str, int]] = []
    ensure, enqueue = service.store.ensure_held, service.engine.enqueue

    def slow_ensure(*args, **kwargs):  # slow enough that the other admissions pile up behind it
        events.append(("prefill", threading.get_ident()))
        time.sleep(0.02)
        return ensure(*args, **kwargs)

    def spy_enqueue(request, view):
        events.append(("queued", threading.get_ident()))
        return enqueue(request, view)

    service.store.ensure_held = slow_ensure
    service.engine.enqueue = spy_enqueue
    def send(i: int):
        docs = [DocumentRef(text=f"burst {i} passage {j}: {DOCS[j % 2]}") for j in range(3)]
        return service.submit(spec(docs))

    with ThreadPoolExecutor(4) as pool:  # four admissions at once
        futures = list(pool.map(send, range(4)))
    assert all(f.result(timeout=60).error is None for f in futures) and len(futures) == 4
    turns = [list(g) for _, g in itertools.groupby(events, key=lambda e: e[1])]  # by thread, in order
    assert len(turns) == 4  # each admission's events in one run: no other's prefill in between
    assert all([kind for kind, _ in turn][-1] == "queued" and len(turn) >= 4 for turn in turns)
