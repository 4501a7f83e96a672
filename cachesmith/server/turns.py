"""A conversation's earlier turns as token prefixes of its prompt, in time linear in the turns.

In: the tokenizer, the system prompt and a conversation's turns (role, text). Out: the token ids of
the prompt's prefix (`Tokenizer.prefix_ids`) or of the finished conversation
(`Tokenizer.conversation_ids`), with the prefixes of those ids that an earlier turn may have stored
(each earlier prompt head and each finished exchange, as `Tokenizer.earlier_prefixes` names them),
longest first; and `conversation_key`, a name for a conversation's state.

Rendering and tokenizing the conversation again for every earlier turn costs time quadratic in the
turns. Here it is rendered once more with each message's text between markers, which shows where
every message starts and ends, and tokenized once, piece by piece between those places: each
earlier prefix is then a length. Where the template does not render each text verbatim, or the
pieces do not tokenize as the whole does, only the latest `MAX_EXACT_TURNS` earlier turns are
rendered one by one (still linear) and older ones are not looked for. Every prefix handed out is a
prefix of the prompt's own ids, so a stored one is exactly its KV however it was found.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

from cachesmith.model.tokenizer import Tokenizer

MARK = "\u2063\u2062\u2063"  # around each message's text in the marked rendering (invisible separators)
SLOT = "\u2063CACHESMITH_QUESTION\u2063"  # the next question's text: a prompt head ends where it starts
MAX_EXACT_TURNS = 3  # earlier turns rendered one by one when the marked rendering cannot tell
MAX_RETOKENIZED = 4  # text tokenized, at most, in multiples of the conversation's

Turns = Sequence[tuple[str, str]]


def turn_prefixes(tokenizer: Tokenizer, system: str | None, turns: Turns,
                  is_head: bool = True) -> tuple[list[int], list[list[int]]]:
    """(ids, earlier): `ids` the prompt prefix after `turns` (`is_head`) or the finished
    conversation of `turns`; `earlier` its proper prefixes an earlier turn may have stored."""
    ids = tokenizer.prefix_ids(system, turns) if is_head else tokenizer.conversation_ids(system, turns)
    if not turns:
        return ids, []
    lengths = _marked_lengths(tokenizer, system, turns, is_head, ids)
    if lengths is None:
        lengths = _exact_lengths(tokenizer, system, turns, ids)
    return ids, [ids[:n] for n in sorted(set(lengths), reverse=True) if 0 < n < len(ids)]


def conversation_key(namespace: str, system: str | None, turns: Turns) -> str:
    """A digest naming a conversation's state: its store namespace (a tenant's), system prompt and turns."""
    return hashlib.blake2b(repr((namespace, system, tuple(turns))).encode(), digest_size=16).hexdigest()


def _messages(system: str | None, turns: Turns) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": role, "content": content} for role, content in turns]


def _render(tokenizer: Tokenizer, system: str | None, turns: Turns, is_head: bool) -> str:
    messages = _messages(system, turns)
    if is_head:  # the next prompt's text before its question (`Tokenizer.prefix_ids`)
        return tokenizer.chat_text(messages + [{"role": "user", "content": SLOT}]).partition(SLOT)[0]
    return tokenizer.chat_text(messages, add_generation_prompt=False)


def _marked_lengths(tokenizer: Tokenizer, system: str | None, turns: Turns, is_head: bool,
                    ids: list[int]) -> list[int] | None:
    """Token lengths of the earlier prefixes of `ids`, from one marked rendering; None where the
    rendering or the tokenization cannot tell them."""
    if any(MARK in text for text in (system or "", *(content for _, content in turns))):
        return None  # a text holding the marker would be mislocated
    located = _located(tokenizer, system, turns, is_head)
    if located is None:
        return None
    text, starts, ends = located
    closing = _closing(tokenizer, system)
    return _token_lengths(tokenizer, text, _boundaries(turns, text, starts, ends, closing), ids)


def _located(tokenizer: Tokenizer, system: str | None, turns: Turns,
             is_head: bool) -> tuple[str, list[int], list[int]] | None:
    """The rendering, and where each message's text starts and ends in it; None when the template
    does not write every text as it is (a template that trims, or reorders)."""
    pieces = _render(tokenizer, system, [(role, MARK + content + MARK) for role, content in turns],
                     is_head).split(MARK)
    if len(pieces) != 2 * len(turns) + 1 or any(pieces[2 * i + 1] != content
                                                for i, (_, content) in enumerate(turns)):
        return None
    starts, ends, pos = [], [], len(pieces[0])
    for i in range(len(turns)):
        starts.append(pos)
        pos += len(pieces[2 * i + 1])
        ends.append(pos)
        pos += len(pieces[2 * i + 2])
    return "".join(pieces), starts, ends


def _closing(tokenizer: Tokenizer, system: str | None) -> str | None:
    """What the template writes after an assistant message that ends a conversation."""
    _, mark, tail = _render(tokenizer, system, [("user", "?"), ("assistant", MARK)], False).rpartition(MARK)
    return tail if mark else None


def _boundaries(turns: Turns, text: str, starts: list[int], ends: list[int], closing: str | None) -> list[int]:
    """Where each earlier prefix ends in `text`: a prompt head where the next user message's text
    starts, a finished exchange after its assistant message's closing."""
    out = []
    for j in range(len(turns) + 1):
        if j and turns[j - 1][0] != "assistant":
            continue  # a prompt always follows a finished exchange
        if j < len(turns) and turns[j][0] == "user":
            out.append(starts[j])
        if j and closing is not None and text.startswith(closing, ends[j - 1]):
            out.append(ends[j - 1] + len(closing))
    return out


def _token_lengths(tokenizer: Tokenizer, text: str, bounds: list[int], ids: list[int]) -> list[int] | None:
    """The token count of `text[:b]` for the bounds that are token boundaries of `ids`, tokenizing
    the text piece by piece from one boundary to the next. A piece's tokens that equal the next ones
    of `ids` spell it exactly, so its end is a boundary; one whose tokens merge with the next
    piece's is tokenized again with it (at most `MAX_RETOKENIZED` times the text in all). None when
    the text does not tokenize as `ids` (then it is not the prompt's text: a template that trims)
    or the pieces merge past that budget."""
    cuts = sorted({b for b in bounds if 0 < b < len(text)})
    lengths, num_tokens, start, num_chars = [], 0, 0, 0
    for cut in [*cuts, len(text)]:
        piece = tokenizer.encode(text[start:cut])
        num_chars += cut - start
        if ids[num_tokens:num_tokens + len(piece)] == piece:
            num_tokens, start = num_tokens + len(piece), cut
            lengths.append(num_tokens)
        elif num_chars > MAX_RETOKENIZED * len(text):
            return None
    return lengths if num_tokens == len(ids) else None


def _exact_lengths(tokenizer: Tokenizer, system: str | None, turns: Turns, ids: list[int]) -> list[int]:
    """The latest `MAX_EXACT_TURNS` earlier prefixes, each rendered and tokenized on its own (as
    `Tokenizer.earlier_prefixes` does for every turn), where they are prefixes of `ids`."""
    lengths, num_tried = [], 0
    for j in range(len(turns), -1, -1):
        if j and turns[j - 1][0] != "assistant":
            continue
        if num_tried == MAX_EXACT_TURNS:
            break
        num_tried += 1
        heads = [tokenizer.prefix_ids(system, turns[:j])]
        heads += [tokenizer.conversation_ids(system, turns[:j])] if j else []
        lengths += [len(head) for head in heads if ids[:len(head)] == head]
    return lengths
