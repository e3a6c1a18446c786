"""The gateway service and the simulator run one turn pipeline: the same turns, replayed through a
running gateway (three stand-in engines) and through the simulator's glue (three modeled engines),
get the same routing decision, turn by turn.

The turns: four sessions over two long system prompts, growing over four turns each, the first
with a subagent. Load is equal everywhere when each turn arrives (one turn at a time, idle
engines) and KV usage is weighted 0 (the stand-in engines report none), so what decides is what the
pipeline feeds the router: the session's home, the prefix matches, the parent and its siblings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

from benchmarks.sim.cluster import MODEL, SimConfig, simulate
from benchmarks.sim.traces import Dep, Play, TraceRequest
from gateway.core.router import RoutingParams
from gateway.core.turn import approx_hashes
from gateway.protocol import parse_body
from gateway.service.prompts import prompt_text
from tests.conftest import ServedGateway, fake_engine, wait_ready

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


@contextlib.contextmanager
def _engines() -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(fake_engine("--model", MODEL, "--tokens", "4")) for _ in range(3)]


def _config(urls: list[str]) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "default",
                "role": "any",
                "engines": [{"name": f"w{i}", "url": u, "model": MODEL} for i, u in enumerate(urls)],
            }
        ],
        "routing": {"profile": "agentic", "weights": WEIGHTS, "approx_chunk_chars": CHUNK},
        "timeouts": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
    }


def test_the_service_and_the_simulator_route_the_same_turns_to_the_same_engines() -> None:
    turns = _turns()
    # the gateway, turn by turn
    served: list[tuple[str, str]] = []
    with _engines() as urls, ServedGateway(_config(urls)) as gw:
        wait_ready(gw.url)
        with httpx.Client(base_url=gw.url, timeout=30) as client:
            for session, parent, _, messages in turns:
                headers = {"x-agent-session-id": session, "x-agent-tool-latency-ms": "1000"}
                if parent is not None:
                    headers |= {"x-agent-parent-session-id": parent, "x-agent-fan-out": "1"}
                r = client.post("/v1/chat/completions", content=_body(messages), headers=headers)
                assert r.status_code == 200, r.text
                served.append((r.headers["x-agentgw-engine"], r.headers["x-agentgw-reason"]))
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
