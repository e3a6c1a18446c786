"""An ApiError renders in Anthropic's error shape with Anthropic's error type for its status; a
wire adapter's BadRequest renders through it."""

from __future__ import annotations

import orjson
import pytest

from gateway.api.errors import ApiError, anthropic_error_type, to_api_error
from gateway.errors import BadRequest
from gateway.wire.anthropic import parse_messages

TYPES = [
    (400, "invalid_request_error"),
    (401, "authentication_error"),
    (403, "permission_error"),
    (404, "not_found_error"),
    (413, "request_too_large"),
    (429, "rate_limit_error"),
    (500, "api_error"),
    (502, "api_error"),
    (503, "overloaded_error"),
    (504, "timeout_error"),
    (529, "overloaded_error"),
    (418, "invalid_request_error"),
    (599, "api_error"),
]


@pytest.mark.parametrize(("status", "kind"), TYPES)
def test_error_type_per_status(status: int, kind: str) -> None:
    assert anthropic_error_type(status) == kind
    body = orjson.loads(ApiError(status, "boom").anthropic_body())
    assert body == {"type": "error", "error": {"type": kind, "message": "boom"}}


def test_a_bad_messages_request_renders_naming_the_field() -> None:
    with pytest.raises(BadRequest) as err:
        parse_messages({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": 3}]})
    api = to_api_error(err.value)
    body = orjson.loads(api.anthropic_body())
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content" in body["error"]["message"]
    # the OpenAI shape is unchanged
    assert orjson.loads(api.body())["error"]["param"] == "messages[0].content"


@pytest.mark.parametrize(
    ("max_tokens", "kv", "ok"),
    [("4096", None, True), ("1024", None, False), (2048.0, None, True), ("4096", [1], True)],
)
def test_thinking_budget_is_compared_with_the_parsed_max_tokens(
    max_tokens: object, kv: object, ok: bool
) -> None:
    """``max_tokens`` as a numeric string (lax ints, as vLLM's pydantic reads them) with thinking
    enabled was compared as a string: ``int >= str``, a 500."""
    body: dict[str, object] = {
        "model": "m",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    if kv is not None:
        body["kv_transfer_params"] = kv
    if ok and kv is None:
        parse_messages(body)
        return
    with pytest.raises(BadRequest) as err:
        parse_messages(body)
    assert to_api_error(err.value).status == 400
    assert err.value.field == ("kv_transfer_params" if kv is not None else "thinking.budget_tokens")
