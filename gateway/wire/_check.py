"""Shape checks shared by the wire converters: each failure is a
:class:`~gateway.errors.BadRequest` naming the field.

The checks mirror the pydantic types vLLM 0.32 declares for the same field (a string field takes
no number, an integer field takes an integral float, an optional field takes ``null``), so what
passes here is what vLLM accepts; the converters only read values that passed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import orjson

from gateway.errors import BadRequest


def load_object(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``: a 400 when it is not JSON or not an object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", None, "invalid_json")
    return body


def missing(field: str) -> BadRequest:
    return BadRequest(f"'{field}' is required", field, "missing_required_parameter")


def wrong(field: str, what: str) -> BadRequest:
    return BadRequest(f"'{field}' must be {what}", field, "invalid_type")


def bad_value(field: str, message: str) -> BadRequest:
    return BadRequest(f"'{field}' {message}", field, "invalid_value")


def opt_str(d: Mapping[str, Any], key: str, field: str) -> str | None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise wrong(field, "a string")
    return v


def req_str(d: Mapping[str, Any], key: str, field: str) -> str:
    if d.get(key) is None:
        raise missing(field)
    v = opt_str(d, key, field)
    assert v is not None
    return v


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(v: Any) -> bool | None:
    """``v`` as pydantic's lax ``bool`` reads it (``None`` when it is not a boolean)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        t = v.strip().lower()
        if t in _TRUE:
            return True
        if t in _FALSE:
            return False
    return None


def opt_bool(d: Mapping[str, Any], key: str, field: str) -> bool | None:
    v = d.get(key)
    if v is None:
        return None
    b = lax_bool(v)
    if b is None:
        raise wrong(field, "a boolean")
    return b


def opt_int(d: Mapping[str, Any], key: str, field: str) -> int | None:
    """An integer as pydantic's lax ``int`` reads it (an integral float or a numeric string too)."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, str):
        try:
            v = float(v.strip()) if any(ch in v for ch in ".eE") else int(v.strip())
        except ValueError:
            raise wrong(field, "an integer") from None
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise wrong(field, "an integer")
    return v


def opt_num(d: Mapping[str, Any], key: str, field: str) -> float | None:
    """A number as pydantic's lax ``float`` reads it (a numeric string too)."""
    v = d.get(key)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            raise wrong(field, "a number") from None
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
        raise wrong(field, "a number")
    return v


def opt_obj(d: Mapping[str, Any], key: str, field: str) -> dict[str, Any] | None:
    v = d.get(key)
    if v is not None and not isinstance(v, dict):
        raise wrong(field, "an object")
    return v


def opt_list(d: Mapping[str, Any], key: str, field: str) -> list[Any] | None:
    v = d.get(key)
    if v is not None and not isinstance(v, list):
        raise wrong(field, "an array")
    return v


def opt_enum(d: Mapping[str, Any], key: str, field: str, allowed: Collection[str]) -> str | None:
    v = d.get(key)
    if v is not None and (not isinstance(v, str) or v not in allowed):
        raise bad_value(field, f"must be one of {', '.join(repr(a) for a in allowed)}")
    return v


def req_enum(d: Mapping[str, Any], key: str, field: str, allowed: Collection[str]) -> str:
    if d.get(key) is None:
        raise missing(field)
    v = opt_enum(d, key, field, allowed)
    assert v is not None
    return v


def obj(v: Any, field: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise wrong(field, "an object")
    return v
