"""One request path: a chat completion reaches `BatchRunner.run` with each chunk keyed (hashed) once
and its entry opened once (verified where staging reads it), the engine never re-derives a prompt, and
each rule of every request is checked once."""
from __future__ import annotations

import sys
from collections import Counter

import httpx
import pytest

from cachesmith import request as rules
from cachesmith.kvstore import ChunkStore, keys
from cachesmith.pipeline import RagPipeline
from cachesmith.recompute import BatchRunner
from cachesmith.server.run import BackgroundServer
from tests.server.conftest import NAME, make_service

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

DOCS = ("river glacier lantern harbor meadow falcon", "copper amber silent frozen canyon velvet")


class Spies:
    def __init__(self, monkeypatch) -> None:
        self.keyed, self.opened, self.runs, self.held, self.hashed = [], [], [], [], []
        real_key, real_open, real_run = ChunkStore.key_for, ChunkStore.open, BatchRunner.run
        real_held = ChunkStore.ensure_held

        def key_for(store, model, token_ids, namespace=""):
            self.keyed.append(tuple(token_ids))
            return real_key(store, model, token_ids, namespace)

        def open_(store, key, model=None, keyed=None):
            self.opened.append(key)
            return real_open(store, key, model, keyed)

        def ensure_held(store, model, token_ids, *args):
            self.held.append(tuple(token_ids))
            return real_held(store, model, token_ids, *args)

        def run(runner, requests, *args, **kwargs):
            self.runs.append([len(r.chunks) for r in requests])
            try:
                return real_run(runner, requests, *args, **kwargs)
            finally:  # what was opened up to the first token (a chat's turn is stored after it)
                self.num_opened_by_answer = len(self.opened)

        def hashed(model_fingerprint, dtype, token_ids, *args, **kwargs):  # every sha256 of a chunk
            self.hashed.append(tuple(token_ids))
            return real_hash(model_fingerprint, dtype, token_ids, *args, **kwargs)

        # each module holding the hash gets the spy, so an inline call is counted too
        real_hash = keys.chunk_key
        for module in [m for n, m in list(sys.modules.items())
                       if n.startswith("cachesmith") and getattr(m, "chunk_key", None) is real_hash]:
            monkeypatch.setattr(module, "chunk_key", hashed)
        monkeypatch.setattr(ChunkStore, "key_for", key_for)
        monkeypatch.setattr(ChunkStore, "open", open_)
        monkeypatch.setattr(ChunkStore, "ensure_held", ensure_held)
        monkeypatch.setattr(BatchRunner, "run", run)
        # the server keys the prompt itself; nothing below it keys it again
        monkeypatch.setattr(RagPipeline, "stored_prompt", lambda *a: pytest.fail("the prompt was keyed again"))
        self.real_key = real_key

    def reset(self) -> None:
        self.keyed.clear(), self.opened.clear(), self.runs.clear(), self.held.clear(), self.hashed.clear()


def chat(url: str) -> dict:
    body = {"model": NAME, "messages": [{"role": "user", "content": "Which word comes after river?"}],
            "documents": list(DOCS), "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture()
def served(tiny_chat_dir):
    service = make_service(tiny_chat_dir)
    srv = BackgroundServer(service).start()
    yield srv, service
    srv.stop()


def test_a_chat_completion_keys_each_chunk_once_and_opens_its_entry_once(served, monkeypatch):
    srv, service = served
    pipe = service.pipeline
    chunk_ids = [tuple(pipe.tokenizer.chunk_ids(d)) for d in DOCS]
    spies = Spies(monkeypatch)
    chunk_keys = [spies.real_key(pipe.store, pipe.model, list(ids)) for ids in chunk_ids]
    for is_stored in (False, True):  # first sight (prefilled, then stored), then read from the store
        spies.reset()
        answer = chat(srv.url)
        assert answer["choices"][0]["message"]["content"] is not None
        assert sorted(k for k in spies.keyed if k in chunk_ids) == sorted(chunk_ids), is_stored  # keyed once
        assert sorted(k for k in spies.hashed if k in chunk_ids) == sorted(chunk_ids), is_stored  # one sha256 each
        assert [spies.opened.count(k) for k in chunk_keys] == [1, 1], is_stored  # opened once: staging
        if not is_stored:  # the prefix too, on a miss (the first exchange's turn store, in the
            # background after its answer, reads it again and may overlap the next request)
            assert max(Counter(spies.opened[:spies.num_opened_by_answer]).values()) == 1
        assert spies.runs == [[2]], is_stored  # one batch of this request, both chunks staged
        # a chunk found missing is stored; one found stored is not looked up a second time
        assert sorted(k for k in spies.held if k in chunk_ids) == ([] if is_stored else sorted(chunk_ids))


RULES = ("check_slo", "check_max_tokens", "check_fits")  # the rules of every request (`cachesmith.request`)


def spy_rules(monkeypatch) -> Counter:
    """Count each rule's calls wherever it is called from: every loaded cachesmith module that holds
    the rule function gets a counting wrapper in its place."""
    calls: Counter = Counter()
    for name in RULES:
        real = getattr(rules, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        holders = [m for n, m in list(sys.modules.items()) if n.startswith("cachesmith") and getattr(m, name, None) is real]
        assert any(m.__name__.startswith("cachesmith.server.") for m in holders), name  # the front calls it
        for module in holders:
            monkeypatch.setattr(module, name, spy)
    return calls


def test_each_rule_is_checked_once_per_served_request(served, monkeypatch):
    """The SLO, the token budget and the model's positions are each checked once, at the front
    (naming the client's fields); below it the engine trusts the typed `Request`."""
    srv, _ = served
    calls = spy_rules(monkeypatch)
    for is_stored in (False, True):  # first sight, then its chunks read from the store
        calls.clear()
        chat(srv.url)
        assert {name: calls[name] for name in RULES} == dict.fromkeys(RULES, 1), is_stored


def _readers(attribute: str) -> set[str]:
    """`module:function` of every function in the package that reads `<something>.attribute`."""
    import ast
    from pathlib import Path

    import cachesmith

    root, found = Path(cachesmith.__file__).parent, set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(isinstance(n, ast.Attribute) and n.attr == attribute and isinstance(n.ctx, ast.Load)
                       for n in ast.walk(fn)):
                    found.add(f"{path.relative_to(root).with_suffix('')}:{fn.name}")
    return found


@pytest.mark.parametrize("limit", ["max_tokens_limit", "max_slo_s", "min_slo_s", "max_documents"])
def test_each_request_limit_is_read_by_one_check_only(limit):
    """Besides the configuration validating itself and the published schema stating it, one
    function reads each request limit: a check written inline a second time would read it too (a
    spy on the check functions cannot see that)."""
    readers = _readers(limit) - {"server/openapi:_limits", "server/specs:__post_init__", "cli:_serve"}  # the flag passed on
    assert readers == {"server/service:_limits"} or (limit.endswith("slo_s") and readers == {"server/service:_slo_s"}), \
        readers
