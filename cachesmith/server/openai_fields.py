"""OpenAI request fields cachesmith accepts without acting on them, and those it refuses.

In: the request bodies' pydantic models (as mixins). Out: the fields, their checks, and
`ignored_fields(body)`: the names a request sent that the server did not act on (the app logs
them and names them in the `x-cachesmith-ignored-fields` response header). A body may carry any
name of any length: `IgnoredFieldsLog` logs them escaped and cut short, each set of names at most
once a minute, so a client can neither forge log lines nor flood the log.

Frameworks built on the OpenAI SDK send fields such as `tools=[]`, `store`, `metadata` or
`parallel_tool_calls` on every call; refusing them would lock those clients out, and ignoring them
changes nothing about the answer. Fields whose meaning ignoring would silently break are refused
with a 400 naming the field: tools the model would have to call, a structured `response_format`,
`logit_bias`, audio output, `n` > 1 (in the schemas). Each rule is also stated in the published
schema, so a schema-driven client knows it before sending.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from cachesmith.server.json_types import Bool

MAX_LOGGED_NAMES, MAX_LOGGED_NAME_CHARS = 10, 64
LOG_EVERY_S = 60.0  # a set of names is logged at most this often
MAX_LOGGED_SETS = 256  # distinct sets logged per LOG_EVERY_S: a client inventing names cannot flood the log


class CommonFields(BaseModel):
    """Fields of both completions and chat completions that the server does not act on."""
    logit_bias: dict[str, Any] | None = Field(default=None, json_schema_extra={"maxProperties": 0})
    metadata: dict[str, Any] | None = None
    store: Bool | None = None
    service_tier: str | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias):
        if bias:  # an empty map biases nothing: accepted
            raise ValueError("not supported: cachesmith cannot bias token choices (send {} or leave it out)")
        return bias


class ResponseFormat(BaseModel):
    type: Literal["text"] = Field(description="only plain text: the answer is not constrained to a schema")


# a tool list the model would have to use: refused (the published schema says the same with anyOf)
TOOLS_RULE = {"anyOf": [{"properties": {"tools": {"maxItems": 0}}},
                         {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "none"}}}]}


class ChatFields(BaseModel):
    """Chat-only fields that the server does not act on (tools it may not call, plain text out)."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: Bool | None = None
    response_format: ResponseFormat | None = None
    functions: list[dict[str, Any]] | None = Field(default=None, max_length=0)  # deprecated: tools
    function_call: Literal["none", "auto"] | None = None
    modalities: list[Literal["text"]] | None = None
    audio: None = None  # audio output: refused by the type (only null)
    reasoning_effort: str | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None

    @model_validator(mode="after")
    def _tools_not_called(self):
        if self.tools and self.tool_choice != "none":
            raise ValueError(f"tools: {len(self.tools)} tool(s) with tool_choice={self.tool_choice!r}: cachesmith "
                             f"does not call tools; send tool_choice=\"none\" or no tools")
        return self


# named in the ignored-fields header when a request sends them: every field these mixins declare
COMMON_IGNORED = tuple(CommonFields.model_fields)
CHAT_IGNORED = tuple(ChatFields.model_fields)


def ignored_fields(body: BaseModel) -> list[str]:
    """The fields the request sent that the server did not act on: the known OpenAI ones it holds
    without effect, then unknown ones (`extra="allow"`), each by name."""
    known = [name for name in (*COMMON_IGNORED, *CHAT_IGNORED)
             if name in body.model_fields_set and name in type(body).model_fields]
    return known + sorted(body.model_extra or {})


def loggable_names(names: list[str]) -> str:
    """`names` for a log line: each escaped (no raw newline or control character, non-ASCII as
    escapes) and cut to `MAX_LOGGED_NAME_CHARS`; at most `MAX_LOGGED_NAMES`, then how many more."""
    shown = []
    for name in names[:MAX_LOGGED_NAMES]:
        escaped = name.encode("unicode_escape").decode("ascii")
        shown.append(escaped if len(escaped) <= MAX_LOGGED_NAME_CHARS else escaped[:MAX_LOGGED_NAME_CHARS] + "...")
    more = len(names) - len(shown)
    return ", ".join(shown) + (f", +{more} more" if more else "")


class IgnoredFieldsLog:
    """Logs the fields a request sent that had no effect: each set of names (as logged) at most
    once per `LOG_EVERY_S`, and at most `MAX_LOGGED_SETS` sets in that time."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S) -> None:
        self.logger, self.every_s = logger, every_s
        self._last: dict[str, float] = {}  # line -> when it was last logged
        self._lock = threading.Lock()

    def log(self, names: list[str]) -> bool:
        """Log `names` unless logged lately; True if a line was written."""
        line, now = loggable_names(names), time.monotonic()
        with self._lock:
            if now - self._last.get(line, -math.inf) < self.every_s:
                return False
            if len(self._last) >= MAX_LOGGED_SETS:  # forget the lines that are due again
                self._last = {k: t for k, t in self._last.items() if now - t < self.every_s}
                if len(self._last) >= MAX_LOGGED_SETS:
                    return False
            self._last[line] = now
        self.logger.warning("request fields accepted but not acted on: %s", line)
        return True
