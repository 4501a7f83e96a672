"""Tokenizer wrapper: plain encoding (no special tokens added), decoding, and the chat template.

In: a model directory with HF tokenizer files. Out: token id lists. `rag_prompt_parts` splits a chat
prompt into prefix / per-document chunks / suffix, tokenized separately, so that full prefill and
chunk reuse see exactly the same token sequence.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError

from cachesmith.errors import InputError, ModelAssetError

_SLOT = "\u2063CACHESMITH_DOCUMENTS\u2063"


@dataclass(frozen=True)
class PromptParts:
    prefix_ids: list[int]
    chunk_ids: list[list[int]]
    suffix_ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        return self.prefix_ids + [t for c in self.chunk_ids for t in c] + self.suffix_ids


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelAssetError(f"{model_dir}: tokenizer files cannot be loaded: {exc}") from exc

    def encode(self, text: str, field: str = "text") -> list[int]:
        if not isinstance(text, str):
            raise InputError(f"{field} must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=False))

    def chunk_ids(self, document: str, separator: str = "\n\n", field: str = "document") -> list[int]:
        """Token ids of one document as a chunk: exactly what a prompt built from it contains."""
        return self.encode(document + separator, field=field)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text as it appears in decoded output (special tokens included)."""
        return self.hf.decode([token_id])

    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def chat_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.has_chat_template():
            return "\n".join(m["content"] for m in messages) + "\n"
        try:
            return self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        except TemplateError as exc:  # a template's own rule (roles that must alternate, ...)
            raise InputError(f"messages: the model's chat template refuses this conversation: {exc}") from exc

    def rag_prompt_parts(self, documents: Sequence[str], question: str,
                         system: str | None = None, separator: str = "\n\n",
                         answer_prefix: str = "", history: Sequence[tuple[str, str]] = ()) -> PromptParts:
        """Chat prompt whose last user turn is the documents followed by the question; `history`
        (earlier (role, content) turns) goes into the prefix before it; `answer_prefix` opens the
        assistant turn (part of the always-computed suffix). No documents: a plain chat turn."""
        for i, doc in enumerate(documents):
            if not isinstance(doc, str) or not doc.strip():
                raise InputError(f"documents[{i}] must be a non-empty string")
        if not isinstance(question, str) or not (question.strip() or documents):  # documents alone: about them
            raise InputError("question must be a non-empty string")
        head, tail = self._around_documents(system, history)
        return PromptParts(
            prefix_ids=self.encode(head),
            chunk_ids=[self.chunk_ids(doc, separator, field=f"documents[{i}]")
                       for i, doc in enumerate(documents)],
            suffix_ids=self.encode(question + tail + answer_prefix, field="question"),
        )

    def frame_ids(self, question: str, system: str | None = None, answer_prefix: str = "",
                  history: Sequence[tuple[str, str]] = ()) -> tuple[list[int], list[int]]:
        """The token ids `rag_prompt_parts` puts before the documents and after them."""
        head, tail = self._around_documents(system, history)
        return self.encode(head), self.encode(question + tail + answer_prefix, field="question")

    def frame_lengths(self, question: str, system: str | None = None, answer_prefix: str = "",
                      history: Sequence[tuple[str, str]] = ()) -> tuple[int, int]:
        """How many tokens `rag_prompt_parts` puts before the documents and after them."""
        prefix_ids, suffix_ids = self.frame_ids(question, system, answer_prefix, history)
        return len(prefix_ids), len(suffix_ids)

    def _around_documents(self, system: str | None, history: Sequence[tuple[str, str]]) -> tuple[str, str]:
        """The chat text before and after the last user turn's content."""
        head, tail = self.chat_text(_messages(system, history) + [{"role": "user", "content": _SLOT}]).split(_SLOT)
        return head, tail

    def prefix_ids(self, system: str | None, history: Sequence[tuple[str, str]] = ()) -> list[int]:
        """Token ids of a prompt's prefix: system, earlier turns and the last user turn's opening
        (what `rag_prompt_parts` puts before the documents)."""
        return self.encode(self._around_documents(system, history)[0])

    def conversation_ids(self, system: str | None, turns: Sequence[tuple[str, str]]) -> list[int]:
        """Token ids of a finished conversation (no generation prompt): what the next turn's prompt
        starts with, so its KV can be stored for that turn."""
        return self.encode(self.chat_text(_messages(system, turns), add_generation_prompt=False))

    def earlier_prefixes(self, system: str | None, history: Sequence[tuple[str, str]]) -> list[list[int]]:
        """Token ids a stored earlier prompt prefix of this conversation may hold: each earlier
        turn's prompt head and each finished exchange, longest first."""
        heads = []
        for j in range(len(history), -1, -1):
            if j and history[j - 1][0] != "assistant":
                continue  # a prompt always follows a finished exchange
            heads.append(self.prefix_ids(system, history[:j]))
            if j:
                heads.append(self.conversation_ids(system, history[:j]))
        return heads


def _messages(system: str | None, turns: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": role, "content": content} for role, content in turns]
