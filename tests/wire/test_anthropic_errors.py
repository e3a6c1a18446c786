"""An ApiError renders in Anthropic's error shape with Anthropic's error type for its status."""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import ApiError, anthropic_error_type
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
    with pytest.raises(ApiError) as err:
        parse_messages({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": 3}]})
    body = orjson.loads(err.value.anthropic_body())
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content" in body["error"]["message"]
    # the OpenAI shape is unchanged
    assert orjson.loads(err.value.body())["error"]["param"] == "messages[0].content"
