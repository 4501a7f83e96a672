"""Chat messages and how a conversation becomes the parts of a RAG prompt.

In: the `messages` of a chat completion body. Out (`chat_parts`): the system prompt, the earlier
turns (the exact prefix whose KV a conversation's next turn reuses), the question, the text that
opens the answer, and the documents sent inside messages: the completion spec's fields, which the
body builds its one `CompletionSpec` from.

Documents inside messages: a client that cannot add a `documents` field (a framework that builds
the request for it) sends each retrieved passage as a content part marked as one:
`{"type": "text", "text": "...", "document": true}` (optionally with `"title"`), in a system (or
developer) message or in the last user message, the question's turn. Each becomes a chunk, as an
entry of `documents` would, after those of `documents`, in message order. Parts not marked are
the message's text, joined. In earlier turns, document parts are that turn's text.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from cachesmith.errors import InputError
from cachesmith.server.json_types import NON_BLANK, Bool

SYSTEM_ROLES = ("system", "developer")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(pattern=NON_BLANK)
    document: Bool = Field(
        False, description="cachesmith: this part is a retrieved document (stored and reused as a chunk)")
    title: str | None = Field(None, description="cachesmith: a document part's title (joined before its text)")

    @property
    def passage(self) -> str:
        return f"{self.title}\n{self.text}" if self.title and self.title.strip() else self.text


def _content_shape(content) -> str | None:
    return "str" if isinstance(content, str) else "TextParts" if isinstance(content, list) else None


class ChatMessage(BaseModel):
    # SDKs echo an earlier reply's fields back (refusal, annotations, ...): kept, named as ignored
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[
        Annotated[str, Field(pattern=NON_BLANK), Tag("str")]
        | Annotated[list[TextPart], Field(min_length=1), Tag("TextParts")],
        # a bad value reports its own shape's errors only, not the other's too
        Discriminator(_content_shape, custom_error_type="content_shape",
                      custom_error_message="content is a string or a list of text parts")]
    name: str | None = None

    @property
    def text(self) -> str:
        """The message's text: its parts that are not documents."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if not p.document)

    @property
    def full_text(self) -> str:
        """Every part's text, documents included (a turn as the conversation had it)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    @property
    def documents(self) -> list[str]:
        return [] if isinstance(self.content, str) else [p.passage for p in self.content if p.document]


ChatParts = tuple[str, tuple[tuple[str, str], ...], str, "str | None", tuple[str, ...]]


def chat_parts(messages: list[ChatMessage]) -> ChatParts:
    """System (or developer) messages anywhere join the system prompt, in order. The last user
    message is the question; the turns before it are the history. Assistant messages after the
    question open the answer, which the model continues. Document parts of the system messages and
    of the question's turn are documents; an earlier turn's are part of that turn's text (the
    conversation as it was), and a question's turn of documents alone asks about them. Returns
    (system, history as (role, text) turns, question, answer opening or None, documents)."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if not users:
        raise InputError("messages: a user message (the question) is required; got roles "
                         f"{[m.role for m in messages]}")
    last = users[-1]
    system = [m for m in messages if m.role in SYSTEM_ROLES]
    turns = [m for m in messages[:last] if m.role not in SYSTEM_ROLES]
    after = [m for m in messages[last + 1:] if m.role not in SYSTEM_ROLES]  # assistant messages only
    documents = [d for i, m in enumerate(messages) if m.role in SYSTEM_ROLES or i == last for d in m.documents]
    return ("\n\n".join(m.text for m in system if m.text), tuple((m.role, m.full_text) for m in turns),
            messages[last].text, "\n\n".join(m.full_text for m in after) if after else None, tuple(documents))
