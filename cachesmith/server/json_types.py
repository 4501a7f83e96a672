"""JSON types as the published schema states them, for the request bodies.

pydantic's lax mode reads `true` as 1 and "yes" as a boolean, and its strict mode refuses 2.0
as an integer; both disagree with JSON Schema, which schema-driven clients and fuzzers follow.
These annotated types accept exactly what the schema says. JSON's `\\u` escapes can also spell a
lone surrogate, which is no Unicode text (UTF-8 cannot encode it: no tokenizer, header or response
can carry it); `UnicodeBody` refuses one anywhere in a body, once for the whole body, naming where.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, Field, model_validator

# at least one character that is not whitespace, whitespace being what str.strip() removes (the
# service's check): a bare \S means another set in the ECMA regexes schema validators use
NON_BLANK = r"[^\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
SAFE_INT = 2**53  # larger integers do not survive a JSON number in every client
MAX_NAMED_CHARS = 64  # of a field name quoted in an error


def json_integer(value):
    """JSON Schema's integer: any number with no fraction (2.0 too), never a boolean (pydantic's lax
    mode reads true as 1, its strict mode refuses 2.0; both disagree with the published schema)."""
    if isinstance(value, bool):
        raise ValueError("must be an integer, not a boolean")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def json_boolean(value):
    if not isinstance(value, bool):  # lax mode would take 0, 1, "yes"
        raise ValueError("must be true or false")
    return value


def json_number(value):
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


def json_int(**limits):
    """An integer field with `limits` (Field's ge, le, ...): the limits come first, or the schema
    would publish pydantic's names for them instead of minimum / maximum."""
    return Annotated[int, Field(**limits), BeforeValidator(json_integer)]


def json_float(**limits):
    return Annotated[float, Field(**limits), BeforeValidator(json_number)]


Bool = Annotated[bool, BeforeValidator(json_boolean)]


def schema_pattern(pattern: str):
    """A pattern the published schema states while the check itself stays in code, where its
    error message names the rule ("must not be empty", "64 lower-case hex digits")."""
    return Field(json_schema_extra={"pattern": pattern})


def _bad_char(text: str) -> int | None:
    """Where `text` stops being encodable as UTF-8 (a lone surrogate), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _named(text: str) -> str:
    """A field name as an error quotes it: escaped where not printable as UTF-8, cut short."""
    escaped = text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\n", "\\n")
    return escaped if len(escaped) <= MAX_NAMED_CHARS else escaped[:MAX_NAMED_CHARS] + "..."


def _surrogate(text: str, at: int, what: str) -> str:
    return (f"{what} is not valid Unicode: a lone surrogate \\u{ord(text[at]):04x} at character {at} "
            f"(UTF-8 cannot encode it)")


def unencodable_text(value, path: str = "") -> str | None:
    """"<field>: <why>" for the first string of a parsed JSON value (a text or a field name) that is
    not valid Unicode; None when every one is. Iterative: a body's depth costs no recursion."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if (at := _bad_char(item)) is not None:
                return f"{where or 'body'}: {_surrogate(item, at, 'text')}"
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                name = f"{where}.{_named(key)}" if where else _named(key)
                if isinstance(key, str) and (at := _bad_char(key)) is not None:
                    return f"{name}: {_surrogate(key, at, 'the field name')}"
                children.append((name, child))
            stack += reversed(children)
        elif isinstance(item, list):
            stack += reversed([(f"{where}[{i}]", child) for i, child in enumerate(item)])
    return None


class UnicodeBody(BaseModel):
    """A request body whose every text and field name is valid Unicode, checked once over the
    whole body before its fields are (a 400 naming the field, never a failure further in)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        problem = unencodable_text(data)
        if problem is not None:
            raise ValueError(problem)
        return data
