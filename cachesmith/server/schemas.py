"""Request bodies of the HTTP API: OpenAI's completions and chat completions, extended with
`documents` (texts, or `{"id": ...}` of stored chunks; optional: a plain chat has none) and
`slo_ms`, plus the chunk API. Chat messages may also carry documents as content parts marked
`"document": true` (for clients that cannot add a field).

In: JSON bodies. Out: validated pydantic models and, from them, the service's `CompletionSpec`.
A completion body accepts fields it does not know, and OpenAI's fields it does not act on
(`openai_fields`), which the app names back to the client; the server's `--strict` refuses unknown
ones. Inside a body's parts (documents, options) unknown fields are refused by name. OpenAI
fields cachesmith cannot honour (n > 1, echo, suffix, best_of > 1, tools it would have to call)
are refused with the reason rather than ignored. Every text and field name must be valid Unicode
(no lone surrogate; `json_types.UnicodeBody`). Decoding is greedy unless `temperature` > 0 (then
`top_p`, `top_k`, `seed` and the penalties apply).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from cachesmith.errors import InputError
from cachesmith.kvstore.keys import MAX_CACHE_SALT
from cachesmith.model.sampling import MAX_TOP_LOGPROBS, SamplingParams
from cachesmith.server.json_types import (NON_BLANK, SAFE_INT, Bool, UnicodeBody, json_boolean, json_float,
                                           json_int, json_integer, schema_pattern)
from cachesmith.server.chat_messages import ChatMessage, chat_parts
from cachesmith.server.openai_fields import TOOLS_RULE, ChatFields, CommonFields, ignored_fields
from cachesmith.server.specs import CompletionSpec, DocumentRef
from cachesmith.server.tenancy import Caller

MAX_STOP = 4
CHUNK_ID_PATTERN = "^[0-9a-f]{64}$"
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DocumentId(_Body):
    """`{"id": ...}`: a chunk already in the store, by its 64-hex id."""
    id: str = schema_pattern(CHUNK_ID_PATTERN)  # checked by the service (kvstore.keys)


def _passage(title: str | None, text: str) -> str:
    # the same join for every titled shape, so each stores the same chunk as the string "title\ntext"
    return f"{title}\n{text}" if title and title.strip() else text


class DocumentText(_Body):
    """`{"text": ...}`, or vLLM's and LangChain-like `{"title": ..., "text": ...}`."""
    title: str | None = None
    text: str = schema_pattern(NON_BLANK)

    @field_validator("text")
    @classmethod
    def _not_blank(cls, text: str) -> str:
        if not text.strip():
            raise ValueError("must not be empty")
        return text

    @property
    def passage(self) -> str:
        return _passage(self.title, self.text)


class CohereData(BaseModel):
    """The passage is `snippet` (else `text`), after `title` when given. Cohere lets clients put
    other fields here (url, date, ...): they are accepted and not part of the passage."""
    model_config = ConfigDict(extra="allow", json_schema_extra={"anyOf": [
        {"required": [name], "properties": {name: {"type": "string"}}} for name in ("snippet", "text")]})
    title: str | None = None
    snippet: str | None = Field(default=None, json_schema_extra={"pattern": NON_BLANK})
    text: str | None = Field(default=None, json_schema_extra={"pattern": NON_BLANK})

    @model_validator(mode="after")
    def _has_passage(self):
        if self.snippet is None and self.text is None:
            raise ValueError('needs "snippet" or "text" (the passage)')
        for name in ("snippet", "text"):  # both as the schema says, though only one is the passage
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ValueError(f"{name} must not be empty")
        return self


class CohereDocument(_Body):
    """Cohere's `{"id"?: ..., "data": {...}}`. Its `id` is the client's own name for the document,
    not a stored chunk id: an object with `data` is always a text document."""
    id: str | None = None
    data: CohereData

    @property
    def passage(self) -> str:
        data = self.data
        return _passage(data.title, data.snippet if data.snippet is not None else data.text)


def _shape(doc) -> str | None:
    """Which shape a document is, so a bad one reports that shape's errors only (not every
    shape's); None (no shape) gets the message below."""
    if isinstance(doc, (str, BaseModel)):
        return "str" if isinstance(doc, str) else type(doc).__name__
    if not isinstance(doc, dict):
        return None
    if "data" in doc:
        return "CohereDocument"
    if "text" in doc or "title" in doc:
        return "DocumentText"
    return "DocumentId" if "id" in doc else None


Document = Annotated[
    Annotated[str, schema_pattern(NON_BLANK), Tag("str")] | Annotated[DocumentText, Tag("DocumentText")]
    | Annotated[DocumentId, Tag("DocumentId")] | Annotated[CohereDocument, Tag("CohereDocument")],
    Discriminator(_shape, custom_error_type="document_shape",
                  custom_error_message='a document is a string, {"text": ...} (optionally with "title"), '
                                       '{"id": <stored chunk id>} or {"data": {"snippet" or "text": ...}}')]


class StreamOptions(_Body):
    include_usage: Bool = False
    include_obfuscation: Bool = False  # OpenAI's padding of stream events: none is sent here


class _Generation(UnicodeBody, CommonFields):
    """What completions and chat completions share. Unknown fields are kept (`model_extra`) so
    that the app can name them: frameworks send fields of newer API versions."""
    model_config = ConfigDict(extra="allow")
    model: str
    documents: list[Document] = []  # none: a plain completion, its whole prompt computed
    # its range is the service's rule (`request.check_slo` within ServiceConfig's min_slo_s and
    # max_slo_s), checked there once; the published schema states it (`openapi._limits`)
    slo_ms: json_float(allow_inf_nan=False) | None = None
    max_tokens: json_int(ge=1) | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    temperature: json_float(ge=0, le=2) | None = None  # None or 0: greedy
    top_p: json_float(gt=0, le=1) | None = None
    top_k: json_int(ge=0) | None = None  # an extension, as in vLLM (0: off)
    n: json_int(ge=1, le=1) = 1  # one choice per request
    seed: json_int(ge=-SAFE_INT, le=SAFE_INT) | None = None  # same seed and request -> same text
    presence_penalty: json_float(ge=-2, le=2) | None = None
    frequency_penalty: json_float(ge=-2, le=2) | None = None
    answer_prefix: str = ""  # cachesmith: text that opens the answer (the model continues it)
    gold: list[str] | None = None  # cachesmith: reference answers; gates the answer for QSA metrics
    task: str = "custom"  # cachesmith: how `gold` is scored (a workload task name)
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT)  # vLLM's: shares stored KV only within a salt

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"at most {MAX_STOP} non-empty stop strings")
        return stops

    def sampling(self, num_logprobs: int | None) -> SamplingParams:
        return SamplingParams(self.temperature or 0.0, 1.0 if self.top_p is None else self.top_p, self.top_k or 0,
                              self.seed, self.presence_penalty or 0.0, self.frequency_penalty or 0.0, num_logprobs)

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    def spec(self, question: str, caller: Caller, system: str = "", answer_prefix: str | None = None,
             max_tokens: int | None = None, num_logprobs: int | None = None, documents: tuple[str, ...] = (),
             **chat) -> CompletionSpec:
        """The one `CompletionSpec` of this body; `documents`: passages sent inside messages (after
        `documents`'), `chat`: a chat's own fields (history, stop, every answer budget it gave)."""
        refs = tuple(_document(d) for d in self.documents) + tuple(DocumentRef(text=d) for d in documents)
        return CompletionSpec(refs, question, system, max_tokens or self.max_tokens,
                              None if self.slo_ms is None else self.slo_ms / 1e3, tuple(self.gold or ()), self.task,
                              self.answer_prefix if answer_prefix is None else answer_prefix,
                              self.sampling(num_logprobs), caller=caller, **chat)

    def caller(self, tenant: str) -> Caller:
        return Caller(tenant, self.cache_salt or "")


def _document(doc: Document) -> DocumentRef:
    if isinstance(doc, DocumentId):
        return DocumentRef(chunk_id=doc.id)
    return DocumentRef(text=doc if isinstance(doc, str) else doc.passage)


class CompletionRequest(_Generation):
    prompt: Annotated[str, schema_pattern(NON_BLANK)] | Annotated[
        list[Annotated[str, schema_pattern(NON_BLANK)]], Field(min_length=1, max_length=1)]
    echo: Annotated[Literal[False], BeforeValidator(json_boolean)] = False
    logprobs: json_int(ge=0, le=5) | None = None  # OpenAI's legacy: 0-5
    best_of: Annotated[Literal[1], BeforeValidator(json_integer)] | None = None
    suffix: None = None

    def ignored_fields(self) -> list[str]:
        return ignored_fields(self)

    def to_spec(self, tenant: str = "") -> CompletionSpec:
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise InputError(f"prompt: one prompt per request, got a list of {len(prompt)}")
            prompt = prompt[0]
        return self.spec(prompt, self.caller(tenant), num_logprobs=self.logprobs)


class ChatCompletionRequest(ChatFields, _Generation):
    model_config = ConfigDict(extra="allow", json_schema_extra=TOOLS_RULE)
    # the rule a schema can state; the question is the last of them
    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra={"contains": {
        "type": "object", "properties": {"role": {"const": "user"}}, "required": ["role"]}})
    max_completion_tokens: json_int(ge=1) | None = None
    logprobs: Bool = False
    top_logprobs: json_int(ge=0, le=MAX_TOP_LOGPROBS) | None = None

    def to_spec(self, tenant: str = "") -> CompletionSpec:
        """The conversation's parts (`chat_messages.chat_parts`): the documents go into the last
        user turn, before the question; the turns before it are the exact prefix (their KV is
        stored and reused by the next turn)."""
        system, history, question, prefix, documents = chat_parts(self.messages)
        if prefix is not None:  # cachesmith's answer_prefix goes on where the assistant messages stop
            prefix += self.answer_prefix
        # both are limits on the answer (max_tokens is OpenAI's older name): the tighter one holds
        limits = tuple((f, n) for f, n in (("max_tokens", self.max_tokens),
                                           ("max_completion_tokens", self.max_completion_tokens)) if n is not None)
        return self.spec(question, self.caller(tenant), system, prefix, min((n for _, n in limits), default=None),
                         # asking for top alternatives asks for log-probabilities (a rule a schema can state)
                         (self.top_logprobs or 0) if self.logprobs or self.top_logprobs is not None else None,
                         documents, history=history, is_chat=True, stop=tuple(self.stops), max_tokens_fields=limits)

    def ignored_fields(self) -> list[str]:
        """`openai_fields.ignored_fields`, and the fields messages carried that nothing reads."""
        return ignored_fields(self) + [f"messages[{i}].{name}" for i, m in enumerate(self.messages)
                                       for name in sorted(m.model_extra or {})]


class ChunksRequest(UnicodeBody, _Body):
    documents: list[Annotated[str, schema_pattern(NON_BLANK)]] = Field(min_length=1, max_length=256)
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT)


class FeedbackRequest(UnicodeBody, _Body):
    """A client's verdict on a completion's answer (`passed`: it was right or good enough)."""
    id: str = Field(min_length=1, max_length=128, description="the completion's id, as it was answered")
    passed: bool
