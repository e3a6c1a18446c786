"""Schemathesis against `openapi/agentgw.yaml`: every documented operation of a served gateway
(two stand-in engines as real processes), a bounded, derandomized example count per operation.

Checks on every response: no server error (a 501 only where the contract documents one: the
Responses routes vLLM 0.32 does not serve), a documented status code, content type and headers,
and a body that conforms to the documented schema. The larger run (more examples, every
schemathesis check, stateful phase) is `python -m benchmarks.fuzz`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis  # the dev extra (pinned) installs it: scripts/setup.sh
from hypothesis import HealthCheck, Phase, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import ServedGateway, fake_engine, wait_ready

SPEC = Path(__file__).resolve().parents[2] / "openapi" / "agentgw.yaml"
MODEL = "bench-model"
EXAMPLES = 12

schema = schemathesis.openapi.from_path(str(SPEC))


def gateway_config(a: str, b: str) -> dict:
    return {
        "pools": [
            {
                "name": "p",
                "role": "any",
                "engines": [{"name": "a", "url": a, "model": MODEL}, {"name": "b", "url": b, "model": MODEL}],
            }
        ],
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5, "health_timeout_s": 2},
    }


@pytest.fixture(scope="module")
def fuzz_gateway() -> Iterator[ServedGateway]:
    with (
        fake_engine("--model", MODEL) as a,
        fake_engine("--model", MODEL) as b,
        ServedGateway(gateway_config(a, b)) as gw,
    ):
        wait_ready(gw.url)
        yield gw


def documented(case: object, status: int) -> bool:
    responses = case.operation.definition.raw.get("responses", {})  # type: ignore[attr-defined]
    return str(status) in responses


@pytest.mark.serial  # one item per operation, all with this node id: xdist would run one of them
@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_every_operation_conforms_to_the_contract(case: object, fuzz_gateway: ServedGateway) -> None:
    response = case.call(base_url=fuzz_gateway.url, timeout=30)  # type: ignore[attr-defined]
    status = response.status_code
    assert status < 500 or (status == 501 and documented(case, 501)), (
        f"{case.method} {case.formatted_path}: {status} {response.text[:300]}"  # type: ignore[attr-defined]
    )
    case.validate_response(  # type: ignore[attr-defined]
        response,
        checks=[
            status_code_conformance,
            content_type_conformance,
            response_headers_conformance,
            response_schema_conformance,
        ],
    )


@pytest.mark.parametrize(("method", "path"), [("TRACE", "/v1/models"), ("GET", "/v1/chat/completions")])
def test_wrong_method_answers_405_with_allow(fuzz_gateway: ServedGateway, method: str, path: str) -> None:
    """Found by schemathesis (ST204): a 405 must say which methods the resource allows (RFC 9110)."""
    import httpx

    r = httpx.request(method, fuzz_gateway.url + path, timeout=10)
    assert r.status_code == 405
    assert r.headers.get("allow"), r.headers
    assert r.json()["error"]["type"] == "invalid_request_error"
