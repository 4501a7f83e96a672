"""Input that must neither crash nor flood: text that is no valid Unicode (a lone surrogate, which
JSON's \\u escapes can spell) anywhere in a body is a 400 naming the field; the names of ignored
fields are logged escaped, cut short and at most once a minute per set."""
from __future__ import annotations

import json
import logging

import httpx
import pytest

from cachesmith.server.app import IGNORED_HEADER
from cachesmith.server.openai_fields import MAX_LOGGED_NAME_CHARS, IgnoredFieldsLog, loggable_names
from tests.server.conftest import NAME
from tests.server.test_app import body, error_of

pytestmark = pytest.mark.real_model  # the tiny model borrows the packaged tokenizer

LONE = "\ud800"


def chat(content) -> dict:
    return {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("path, payload, param", [
    ("/v1/completions", body(documents=["a river " + LONE + " glacier"]), "documents[0]"),
    ("/v1/completions", body(documents=[{"title": LONE, "text": "a river"}]), "documents[0].title"),
    ("/v1/completions", body(prompt="Which word" + LONE + "?"), "prompt"),
    ("/v1/chat/completions", chat("Which word" + LONE + "?"), "messages[0].content"),
    ("/v1/chat/completions", chat([{"type": "text", "text": LONE, "document": True}]), "messages[0].content[0].text"),
    ("/v1/completions", {**body(), "x" + LONE: 1}, "x\\ud800"),
    ("/v1/completions", body(metadata={LONE: "v"}), "metadata.\\ud800"),
    ("/v1/chunks", {"documents": ["ok", LONE]}, "documents[1]"),
    ("/v1/completions", body(cache_salt="salt" + LONE), "cache_salt"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(server_for, path, payload, param):
    srv = server_for()
    raw = json.dumps(payload).encode()  # ASCII: the surrogate travels as the escape \ud800, valid JSON
    assert b"\\ud800" in raw
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post(path, content=raw, headers={"content-type": "application/json"})
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == param, r.text
        assert "lone surrogate \\ud800" in err["message"] and err["message"].count(param + ":") == 1
        assert c.get("/health").status_code == 200


def test_an_empty_field_name_is_named_in_a_valid_header(server_for):
    srv = server_for()
    with httpx.Client(base_url=srv.url, timeout=60) as c:  # h11 refuses a header value ending in ", "
        r = c.post("/v1/completions", json=body(**{"": None, "user": "u"}))
        assert r.status_code == 200, r.text
        assert sorted(r.headers[IGNORED_HEADER].split(", ")) == ['""', "user"]


def test_ignored_field_names_are_logged_escaped_short_and_once(server_for, caplog):
    srv = server_for()
    forged = "a\nWARNING forged log line " + "y" * 200  # sorts first: among the names shown
    extra = {forged: 1, **{f"field_{i:02d}": i for i in range(29)}}
    with caplog.at_level(logging.WARNING, logger="cachesmith.server.app"), \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json=body(**extra))
            assert r.status_code == 200 and len(r.headers[IGNORED_HEADER]) <= 1024 + 5
    lines = [rec.getMessage() for rec in caplog.records if "not acted on" in rec.getMessage()]
    assert len(lines) == 1, lines  # the same set again within the minute: not logged again
    line = lines[0]
    assert "\n" not in line and "a\\nWARNING forged" in line and "+20 more" in line
    names = line.split(": ", 1)[1].split(", ")
    assert len(names) == 11 and all(len(n) <= MAX_LOGGED_NAME_CHARS + 3 for n in names)


def test_the_log_of_ignored_fields_is_bounded_per_set_and_in_all():
    logged = []
    log = IgnoredFieldsLog(type("L", (), {"warning": lambda self, fmt, line: logged.append(line)})(), every_s=60)
    assert log.log(["a"]) and not log.log(["a"]) and log.log(["b"])
    num_new = sum(log.log([f"name{i}"]) for i in range(1000))  # a client inventing names on every call
    assert num_new == 256 - 2 and len(logged) == 256
    assert loggable_names(["\u00e9\t" + LONE]) == "\\xe9\\t\\ud800"
