"""The gateway and the simulator drive one routing core: the same turns, replayed through the
gateway's whole hot path (three engines on an injected transport) and through the simulator (three
modeled engines), get the same routing decision, turn by turn.

The turns: four sessions over two long system prompts, growing over four turns each, the first
with a subagent. Load is equal everywhere when each turn arrives (one turn at a time, idle
engines) and KV usage is weighted 0 (the stand-in engines report none), so what decides is what the
pipeline feeds the router: the session's home, the prefix matches, the parent and its siblings.
"""

from __future__ import annotations

from typing import Any

import httpx

from gateway.api.app import create_app
from gateway.config import load_config
from gateway.core.router import RoutingParams
from gateway.core.turn import approx_hashes
from gateway.service.prompts import prompt_text
from gateway.sim.cluster import MODEL, SimConfig, simulate
from gateway.sim.traces import Dep, Play, TraceRequest
from gateway.wire.openai import parse_body

CHUNK = 512
WEIGHTS = {
    "prefix": 3.0,
    "session_affinity": 2.0,
    "parent_prefix": 1.5,
    "spread": 1.0,
    "queue": 1.0,
    "kv_usage": 0.0,
}
SYSTEMS = {
    "a": " ".join(f"rule {i}: keep the build green and the diff small." for i in range(60)),
    "b": " ".join(f"policy {i}: answer briefly, cite the file and the line." for i in range(60)),
}
SYSTEM_OF = {"s0": "a", "s0#sub": "a", "s1": "b", "s2": "a", "s3": "b"}


def _messages(session: str, turns: int) -> list[dict[str, str]]:
    out = [{"role": "system", "content": SYSTEMS[SYSTEM_OF[session]]}]
    for t in range(turns):
        out.append({"role": "user", "content": f"[{session}] step {t}: " + "read the file and fix it. " * 30})
        out.append(
            {"role": "assistant", "content": f"[{session}] done {t}: " + "patched the function. " * 30}
        )
    out.append({"role": "user", "content": f"[{session}] next: run the tests."})
    return out


def _turns() -> list[tuple[str, str | None, str, list[dict[str, str]]]]:
    """(session, parent, stream, messages) in arrival order."""
    out: list[tuple[str, str | None, str, list[dict[str, str]]]] = []
    for s in ("s0", "s1", "s2", "s3"):
        for t in range(4):
            out.append((s, None, "root", _messages(s, t)))
            if s == "s0" and t == 1:
                for k in range(2):
                    out.append(("s0#sub", "s0", "sub", _messages("s0#sub", k)))
    return out


def _play(session: str, turns: list[tuple[str, str | None, str, list[dict[str, str]]]]) -> Play:
    reqs = []
    for i, (_, _, stream, messages) in enumerate(turns):
        parsed = parse_body("chat", _body(messages))
        reqs.append(
            TraceRequest(
                idx=i,
                stream=stream,
                t=0.0,
                input_tokens=parsed.text_chars // 4,
                output_tokens=4,
                hashes=approx_hashes(prompt_text(parsed), CHUNK),
                deps=[Dep(i - 1, "completion", 1.0)] if i else [],
            )
        )
    subagents = {"sub": 1} if any(t[2] == "sub" for t in turns) else {}
    return Play(session, CHUNK // 4, reqs, subagents)


def _body(messages: list[dict[str, str]]) -> bytes:
    import orjson

    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 4})


def _config() -> dict[str, Any]:
    engines = [{"name": f"w{i}", "url": f"http://w{i}.test", "model": MODEL} for i in range(3)]
    return {
        "pools": [{"name": "default", "role": "any", "engines": engines}],
        "routing": {"profile": "agentic", "weights": WEIGHTS, "approx_chunk_chars": CHUNK},
    }


async def _engine(request: httpx.Request) -> httpx.Response:
    """Three idle engines that answer every turn the same (health and metrics: 200, nothing)."""
    if request.url.path != "/v1/chat/completions":
        return httpx.Response(200, text="")
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}
    return httpx.Response(200, json=answer)


async def _served(turns: list[tuple[str, str | None, str, list[dict[str, str]]]]) -> list[tuple[str, str]]:
    """The gateway's decisions, turn by turn (its whole hot path, on an injected transport)."""
    app = create_app(load_config(None, **_config()), transport=httpx.MockTransport(_engine))
    out = []
    async with (
        app.api.router.lifespan_context(app.api),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client,
    ):
        for session, parent, _, messages in turns:
            headers = {"x-agent-session-id": session, "x-agent-tool-latency-ms": "1000"}
            if parent is not None:
                headers |= {"x-agent-parent-session-id": parent, "x-agent-fan-out": "1"}
            r = await client.post("/v1/chat/completions", content=_body(messages), headers=headers)
            assert r.status_code == 200, r.text
            out.append((r.headers["x-agentgw-engine"], r.headers["x-agentgw-reason"]))
    return out


async def test_the_service_and_the_simulator_route_the_same_turns_to_the_same_engines() -> None:
    turns = _turns()
    served = await _served(turns)
    # the simulator, same turns, one play per session, one play at a time
    plays = [_play(s, [t for t in turns if t[0].split("#")[0] == s]) for s in ("s0", "s1", "s2", "s3")]
    sim = simulate(
        plays,
        SimConfig(
            workers=3,
            profile="agentic",
            hints=True,
            lanes=1,
            routing=RoutingParams(profile="agentic", weights=WEIGHTS),
            kv_events=False,
        ),
    )
    simulated = [(r.engine, r.reason) for r in sorted(sim.records, key=lambda r: r.t_arrive)]
    assert len(simulated) == len(served) == len(turns)
    assert simulated == served
    # and the turns exercised more than stickiness: new sessions placed on two engines at least
    # (by prefix), the subagent by its parent
    reasons = {reason for _, reason in served}
    assert {"sticky", "new_session", "subagent_parent"} <= reasons, served
    assert len({engine for engine, _ in served}) >= 2, served
