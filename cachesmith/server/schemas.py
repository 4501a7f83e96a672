"""Request bodies of the HTTP API: OpenAI's completions and chat completions, extended with
`documents` (texts, or `{"id": ...}` of stored chunks) and `slo_ms`, plus the chunk API.

In: JSON bodies. Out: validated pydantic models and, from them, the service's `CompletionSpec`.
Unknown fields are refused by name; OpenAI fields cachesmith cannot honour (n > 1, echo, suffix,
best_of > 1, logprobs with streaming) are refused with the reason rather than ignored. Decoding is
greedy unless `temperature` > 0 (then `top_p`, `top_k`, `seed` and the penalties apply).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Strict, Tag, field_validator, model_validator

from cachesmith.errors import InputError
from cachesmith.model.sampling import MAX_TOP_LOGPROBS, SamplingParams
from cachesmith.server.service import CompletionSpec, DocumentRef

MAX_STOP = 4
CHUNK_ID_PATTERN = "^[0-9a-f]{64}$"
NON_BLANK = r"\S"  # at least one character that is not whitespace
SAFE_INT = 2**53  # larger integers do not survive a JSON number in every client


def _schema_pattern(pattern: str):
    """A pattern the published schema states while the check itself stays in code, where its
    error message names the rule ("must not be empty", "64 lower-case hex digits")."""
    return Field(json_schema_extra={"pattern": pattern})


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DocumentId(_Body):
    """`{"id": ...}`: a chunk already in the store, by its 64-hex id."""
    id: str = _schema_pattern(CHUNK_ID_PATTERN)  # checked by the service (kvstore.keys)


def _passage(title: str | None, text: str) -> str:
    # the same join for every titled shape, so each stores the same chunk as the string "title\ntext"
    return f"{title}\n{text}" if title and title.strip() else text


class DocumentText(_Body):
    """`{"text": ...}`, or vLLM's and LangChain-like `{"title": ..., "text": ...}`."""
    title: str | None = None
    text: str = _schema_pattern(NON_BLANK)

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
        name = "snippet" if self.snippet is not None else "text"
        if not getattr(self, name).strip():
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
    Annotated[str, _schema_pattern(NON_BLANK), Tag("str")] | Annotated[DocumentText, Tag("DocumentText")]
    | Annotated[DocumentId, Tag("DocumentId")] | Annotated[CohereDocument, Tag("CohereDocument")],
    Discriminator(_shape, custom_error_type="document_shape",
                  custom_error_message='a document is a string, {"text": ...} (optionally with "title"), '
                                       '{"id": <stored chunk id>} or {"data": {"snippet" or "text": ...}}')]


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """What completions and chat completions share."""
    model: str
    documents: list[Document] = Field(min_length=1)
    # the service's default limit (ServiceConfig.max_slo_s) is 3600 s; below 1 ms no batch can run
    slo_ms: float | None = Field(default=None, ge=1, le=3_600_000, allow_inf_nan=False)
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, Field(min_length=1)] | Annotated[
        list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)  # None or 0: greedy
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # an extension, as in vLLM (0: off)
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    seed: int | None = Field(default=None, ge=-SAFE_INT, le=SAFE_INT)  # same seed and request -> same text
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    answer_prefix: str = ""  # cachesmith: text that opens the answer (the model continues it)
    gold: list[str] | None = None  # cachesmith: reference answers; gates the answer for QSA metrics
    task: str = "custom"  # cachesmith: how `gold` is scored (a workload task name)

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

    def spec(self, question: str, system: str = "", answer_prefix: str | None = None,
             max_tokens: int | None = None, num_logprobs: int | None = None) -> CompletionSpec:
        if num_logprobs is not None and self.stream:
            raise InputError("logprobs: not available with stream=true; ask without streaming")
        return CompletionSpec(tuple(_document(d) for d in self.documents), question, system,
                              max_tokens or self.max_tokens, None if self.slo_ms is None else self.slo_ms / 1e3,
                              tuple(self.gold or ()), self.task,
                              self.answer_prefix if answer_prefix is None else answer_prefix,
                              self.sampling(num_logprobs))


def _document(doc: Document) -> DocumentRef:
    if isinstance(doc, DocumentId):
        return DocumentRef(chunk_id=doc.id)
    return DocumentRef(text=doc if isinstance(doc, str) else doc.passage)


class CompletionRequest(_Generation):
    prompt: Annotated[str, _schema_pattern(NON_BLANK)] | Annotated[
        list[Annotated[str, _schema_pattern(NON_BLANK)]], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False
    logprobs: Annotated[int, Strict()] | None = Field(default=None, ge=0, le=5)  # OpenAI's legacy: 0-5
    best_of: Literal[1] | None = None
    suffix: None = None

    def to_spec(self) -> CompletionSpec:
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise InputError(f"prompt: one prompt per request, got a list of {len(prompt)}")
            prompt = prompt[0]
        return self.spec(prompt, num_logprobs=self.logprobs)


class TextPart(_Body):
    type: Literal["text"]
    text: str = Field(pattern=NON_BLANK)


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(pattern=NON_BLANK)] | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Annotated[int, Strict()] | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


    def to_spec(self) -> CompletionSpec:
        """System (or developer) messages, then turns alternating user / assistant. The last
        user message is the question; the documents go into that turn, before it. Earlier turns are
        the exact prefix (their KV is stored and reused by the next turn). A last assistant message
        opens the answer, which the model continues (as `answer_prefix`)."""
        # system (or developer) messages anywhere join the system prompt, in order, as one
        system = [m for m in self.messages if m.role in ("system", "developer")]
        rest = [m for m in self.messages if m.role not in ("system", "developer")]
        prefix = rest[-1].text if rest and rest[-1].role == "assistant" else None
        turns = rest[:-1] if prefix is not None else rest
        roles = [m.role for m in turns]
        if not turns or any(r != ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(roles)) \
                or roles[-1] != "user":
            raise InputError("messages: after the system messages, turns must alternate user / assistant, start "
                             "with a user message and end with the user's question (optionally followed by an "
                             f"assistant message to continue); got roles {[m.role for m in rest]}")
        if prefix is not None and self.answer_prefix:
            raise InputError("answer_prefix: give it or a last assistant message, not both")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise InputError("max_tokens and max_completion_tokens disagree; give one")
        spec = self.spec(turns[-1].text, "\n\n".join(m.text for m in system), prefix, self.max_completion_tokens,
                         # asking for top alternatives asks for log-probabilities (a rule a schema can state)
                         (self.top_logprobs or 0) if self.logprobs or self.top_logprobs is not None else None)
        return replace(spec, history=tuple((m.role, m.text) for m in turns[:-1]), is_chat=True,
                       stop=tuple(self.stops))


class ChunksRequest(_Body):
    documents: list[Annotated[str, _schema_pattern(NON_BLANK)]] = Field(min_length=1, max_length=256)
