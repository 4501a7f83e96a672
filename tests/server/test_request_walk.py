"""The request's walk as `docs/layout.md` tells it: every object of the package built while one chat
completion is served is counted by type; the carriers the document lists are each built once, there
are at most six, and an object holding the request's id is of a type the document names."""
from __future__ import annotations

import enum
import importlib
import inspect
import re
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from cachesmith.request import Request
from cachesmith.server.schemas import ChatCompletionRequest
from tests.server.test_request_path import chat, served  # noqa: F401 (a fixture)

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

LAYOUT = Path(__file__).parents[2] / "docs" / "layout.md"
MAX_CARRIERS = 6
WIRE = "server.schemas.ChatCompletionRequest"  # FastAPI validates it without calling __init__: its one `to_spec` counts it


def documented() -> tuple[list[str], set[str]]:
    """(the carriers in walk order, the types beside the walk) as docs/layout.md lists them."""
    text = LAYOUT.read_text().split("## A request's way through", 1)[1].split("\n## ", 1)[0]
    carriers, beside = [], set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`"):
            carriers.append(cells[1].strip("`"))
        elif len(cells) == 2 and cells[0].startswith("`"):
            beside.update(re.findall(r"`([\w.]+)`", cells[0]))
    return carriers, beside


class Census:
    """Counts every instance of every class defined in the package as it is built, by its dotted
    name below `cachesmith.`, and the names of those holding `request_id` (set by `watch`)."""

    def __init__(self, monkeypatch) -> None:
        self.built: Counter = Counter()
        self.holding_id: set[str] = set()
        self.request_id: int | None = None
        self._lock = threading.Lock()
        for cls in _package_classes():
            self._wrap(monkeypatch, cls)
        real_to_spec = ChatCompletionRequest.to_spec

        def to_spec(body, *args, **kwargs):
            self._count(WIRE)
            return real_to_spec(body, *args, **kwargs)

        monkeypatch.setattr(ChatCompletionRequest, "to_spec", to_spec)

    def _wrap(self, monkeypatch, cls) -> None:
        init, name = cls.__init__, f"{cls.__module__.removeprefix('cachesmith.')}.{cls.__qualname__}"

        def counted(obj, *args, **kwargs):
            init(obj, *args, **kwargs)
            if type(obj) is cls:  # a subclass counts as itself
                self._count(name, obj)

        monkeypatch.setattr(cls, "__init__", counted)

    def _count(self, name: str, obj=None) -> None:
        with self._lock:
            self.built[name] += 1
            if isinstance(obj, Request) and self.request_id is None:
                self.request_id = obj.request_id
            if obj is not None and self.request_id is not None and getattr(obj, "request_id", None) == self.request_id:
                self.holding_id.add(name)

    def reset(self) -> None:
        with self._lock:
            self.built.clear(), self.holding_id.clear()
            self.request_id = None


def _package_classes() -> list[type]:
    """Every class a loaded module of the package defines, but exceptions and enums (a NamedTuple
    is built by `__new__`: `StoredEntry` is a part, listed beside the walk)."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("cachesmith"):
            continue
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == name and "__init__" in vars(cls) \
                    and not issubclass(cls, (BaseException, enum.Enum)):
                found[id(cls)] = cls
    return list(found.values())


def test_the_document_lists_at_most_six_carriers_each_a_class_of_the_package():
    carriers, beside = documented()
    assert 0 < len(carriers) <= MAX_CARRIERS, carriers
    for name in [*carriers, *beside]:
        module, _, attr = name.rpartition(".")
        assert inspect.isclass(getattr(importlib.import_module(f"cachesmith.{module}"), attr, None)), name


def test_a_served_request_builds_each_carrier_once_and_nothing_else_holds_it(served, monkeypatch):
    srv, service = served
    carriers, beside = documented()
    census = Census(monkeypatch)
    assert service.config.shedding.is_on  # the front's arrival guess is the view the engine queues
    for is_stored in (False, True):  # new documents (prefilled, then stored), then read from the store
        census.reset()
        chat(srv.url)
        built = {name: census.built[name] for name in carriers}
        assert built == dict.fromkeys(carriers, 1), (is_stored, built)
        # a type holding the request that neither table names would be a carrier the walk hides
        assert census.holding_id - set(carriers) - beside == set(), is_stored
        assert census.request_id is not None and "request.Request" in census.holding_id


def test_the_census_sees_a_copy_of_a_carrier(served, monkeypatch):
    """The counting itself: a spec copied once more on its way (as `replace(spec, ...)` did) is
    seen as a second `CompletionSpec`."""
    from dataclasses import replace

    from cachesmith.server.service import Service

    srv, _ = served
    census = Census(monkeypatch)
    real_submit = Service.submit
    monkeypatch.setattr(Service, "submit", lambda svc, spec, *a, **k: real_submit(svc, replace(spec), *a, **k))
    chat(srv.url)
    assert census.built["server.specs.CompletionSpec"] == 2
