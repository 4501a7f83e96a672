"""Request bodies of the HTTP API: OpenAI's completions and chat completions, extended with
`documents` (texts, or `{"id": ...}` of stored chunks) and `slo_ms`, plus the chunk API.

In: JSON bodies. Out: validated pydantic models and, from them, the service's `CompletionSpec`.
Unknown fields are refused by name; OpenAI fields cachesmith cannot honour (sampling, n > 1,
logprobs, echo, penalties) are refused with the reason rather than ignored. Decoding is greedy.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cachesmith.errors import InputError
from cachesmith.server.service import CompletionSpec, DocumentRef

MAX_STOP = 4


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DocumentId(_Body):
    id: str = Field(min_length=1, max_length=128)


class DocumentText(_Body):
    text: str = Field(min_length=1)


Document = str | DocumentText | DocumentId


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """What completions and chat completions share."""
    model: str
    documents: list[Document] = Field(default_factory=list)
    slo_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = 1
    seed: int | None = None  # decoding is greedy: any seed gives the same answer
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
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

    @model_validator(mode="after")
    def _greedy_only(self):
        refused = [(self.temperature not in (None, 0), "temperature", "only greedy decoding (temperature 0)"),
                   (self.top_p not in (None, 1), "top_p", "only greedy decoding (top_p 1)"),
                   (self.n != 1, "n", "one choice per request (n=1)"),
                   (self.presence_penalty != 0, "presence_penalty", "no penalties"),
                   (self.frequency_penalty != 0, "frequency_penalty", "no penalties")]
        for is_bad, name, what in refused:
            if is_bad:
                raise ValueError(f"{name}: cachesmith supports {what}")
        return self

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    def spec(self, question: str, system: str = "", answer_prefix: str | None = None,
             max_tokens: int | None = None) -> CompletionSpec:
        return CompletionSpec(tuple(_document(d) for d in self.documents), question, system,
                              max_tokens or self.max_tokens, None if self.slo_ms is None else self.slo_ms / 1e3,
                              tuple(self.gold or ()), self.task,
                              self.answer_prefix if answer_prefix is None else answer_prefix)


def _document(doc: Document) -> DocumentRef:
    if isinstance(doc, DocumentId):
        return DocumentRef(chunk_id=doc.id)
    return DocumentRef(text=doc if isinstance(doc, str) else doc.text)


class CompletionRequest(_Generation):
    prompt: str | list[str]
    echo: Literal[False] = False
    logprobs: None = None
    best_of: Literal[1] | None = None
    suffix: None = None

    def to_spec(self) -> CompletionSpec:
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise InputError(f"prompt: one prompt per request, got a list of {len(prompt)}")
            prompt = prompt[0]
        return self.spec(prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def to_spec(self) -> CompletionSpec:
        """System (or developer) messages first, then one user message: the question (the documents
        go into that user turn, before it). A last assistant message opens the answer, which the
        model continues (as `answer_prefix`)."""
        system = [m for m in self.messages if m.role in ("system", "developer")]
        rest = self.messages[len(system):]
        if any(m.role in ("system", "developer") for m in rest):
            raise InputError("messages: system messages must come first")
        roles = [m.role for m in rest]
        if roles not in (["user"], ["user", "assistant"]):
            raise InputError("messages: cachesmith serves single-turn RAG requests: optional system messages, "
                             f"one user message, optionally an assistant message to continue (got roles {roles})")
        prefix = rest[1].text if len(rest) == 2 else None
        if prefix is not None and self.answer_prefix:
            raise InputError("answer_prefix: give it or a last assistant message, not both")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise InputError("max_tokens and max_completion_tokens disagree; give one")
        return self.spec(rest[0].text, "\n\n".join(m.text for m in system), prefix, self.max_completion_tokens)


class ChunksRequest(_Body):
    documents: list[str] = Field(min_length=1, max_length=256)
