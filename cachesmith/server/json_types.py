"""JSON types as the published schema states them, for the request bodies.

pydantic's lax mode reads `true` as 1 and "yes" as a boolean, and its strict mode refuses 2.0
as an integer; both disagree with JSON Schema, which schema-driven clients and fuzzers follow.
These annotated types accept exactly what the schema says.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

# at least one character that is not whitespace, whitespace being what str.strip() removes (the
# service's check): a bare \S means another set in the ECMA regexes schema validators use
NON_BLANK = r"[^\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
SAFE_INT = 2**53  # larger integers do not survive a JSON number in every client


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
