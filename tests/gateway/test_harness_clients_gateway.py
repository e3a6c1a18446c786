"""The real coding-agent clients through the gateway, two turns each: `claude -p` then
`claude -p --continue` (Claude Code, then its `/compact`, which must not count as a turn),
`codex exec` then `codex exec resume --last` (Codex).

Each run exits 0 with an answer; the session API shows each harness's requests as one session;
the second turn is served where its prefix is, and the pass/fail criterion: vLLM's cached tokens
for it (the serving engine's `vllm:prefix_cache_hits_total` delta) equal, within one block, the
block-aligned longest common prefix of the two turns' prompt token ids. The clients talk to the
gateway through a loopback recording proxy (:class:`Recorder`) that keeps each request body and
the gateway's decision headers; the token ids are the gateway's own rendering of those bodies
(the converter of the endpoint, then the model's tokenizer), which
`test_tokenize_vllm_e2e.py` proves equal to vLLM's.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from gateway.analysis.tokenize import ChatTokenizer
from gateway.api import anthropic_routes, responses_routes
from gateway.local.engines import HASH_SEED, LocalEngine
from gateway.local.harness import claude_argv, claude_env, codex_argv, codex_env, harness_clients
from gateway.wire.openai import ParsedRequest
from testing.loopback_proxy import LoopbackProxy
from tests.conftest import MODEL, ServedGateway, engine_metric

pytestmark = pytest.mark.engine

TIMEOUT_S = 300
BLOCK = 128


@dataclass
class Exchange:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    error: bytes = b""
    """The start of an answer that is not a 2xx."""


class Recorder(LoopbackProxy):
    """A loopback HTTP proxy in front of the gateway that records every exchange (answers are
    relayed whole once the gateway's stream ends: the clients read SSE either way)."""

    def __init__(self, target: str) -> None:
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        super().__init__(target, TIMEOUT_S)

    def handle(
        self, client: BaseHTTPRequestHandler, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> None:
        ex = Exchange(method, path, {k.lower(): v for k, v in headers.items()}, body)
        with self._lock:
            self.exchanges.append(ex)
        up = self._http.request(method, path, headers=headers, content=body)
        ex.status = up.status_code
        ex.response_headers = {k.lower(): v for k, v in up.headers.items()}
        if up.status_code >= 300:
            ex.error = up.content[:600]
        self.send_whole(client, up)

    def since(self, start: int, path: str) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges[start:] if e.path.split("?", 1)[0] == path]


@pytest.fixture(scope="module")
def recorder(gateway: ServedGateway) -> Iterator[Recorder]:
    rec = Recorder(gateway.url)
    try:
        yield rec
    finally:
        rec.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> ChatTokenizer:
    return ChatTokenizer(tiny_llama, BLOCK, HASH_SEED)


def run(argv: list[str], env: dict[str, str], home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, cwd=home, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def hits(cluster: dict[str, LocalEngine]) -> dict[str, float]:
    return {n: engine_metric(e.url, "vllm:prefix_cache_hits_total") for n, e in cluster.items()}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Turn:
    exchange: Exchange
    tokens: list[int]
    hits: dict[str, float]
    """Each engine's prefix-cache hits (tokens) during the turn."""
    state: dict[str, Any]
    """The session API's record once the turn is over."""

    @property
    def engine(self) -> str:
        return self.exchange.response_headers["x-agentgw-engine"]

    @property
    def session(self) -> str:
        return self.exchange.response_headers["x-agentgw-session"]


def two_turns(
    name: str,
    path: str,
    parse: Callable[[bytes], ParsedRequest],
    commands: list[list[str]],
    env: dict[str, str],
    home: Path,
    gateway: ServedGateway,
    recorder: Recorder,
    cluster: dict[str, LocalEngine],
    tokenizer: ChatTokenizer,
) -> list[Turn]:
    turns = []
    for argv in commands:
        start = len(recorder.exchanges)
        before = hits(cluster)
        done = run(argv, env, home)
        after = hits(cluster)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
        assert done.stdout.strip(), f"{name} printed no answer: {done.stderr[-2000:]}"
        sent = recorder.since(start, path)
        assert len(sent) == 1, f"{name}: {[(e.method, e.path, e.status) for e in recorder.exchanges[start:]]}"
        ex = sent[0]
        assert ex.status == 200, (name, ex.status)
        parsed = parse(ex.body)
        assert parsed.prompt is not None and parsed.exact
        tokens = list(tokenizer.prompt_info("chat", parsed.prompt).tokens)
        sid = ex.response_headers["x-agentgw-session"]
        state = httpx.get(f"{gateway.url}/v1/agent/sessions/{quote(sid, safe='')}", timeout=10).json()
        turns.append(Turn(ex, tokens, {n: after[n] - before[n] for n in cluster}, state))
    return turns


def check_second_turn(name: str, turns: list[Turn], tokenizer: ChatTokenizer) -> None:
    first, second = turns
    # one session for both turns, as the session API shows it
    assert first.session == second.session, (name, first.session, second.session)
    state = second.state
    assert state["turns"] == 2, (name, state)
    assert state["home_engine"] == second.engine == state["last_decision"]["engine"], (name, state)

    lcp = common_prefix(first.tokens, second.tokens)
    aligned = lcp // BLOCK * BLOCK
    cached = second.hits[second.engine]
    print(
        f"\n{name}: turn 1 {len(first.tokens)} tokens on {first.engine} "
        f"({first.exchange.response_headers['x-agentgw-reason']}), turn 2 {len(second.tokens)} tokens on "
        f"{second.engine} ({second.exchange.response_headers['x-agentgw-reason']}); common prefix {lcp} "
        f"tokens = {lcp / len(first.tokens):.3f} of turn 1's prompt (block-aligned {aligned}); "
        f"vLLM cached {cached:.0f} tokens for turn 2"
    )
    if lcp < len(first.tokens):  # what the harness changed in turn 1's prompt
        dec = tokenizer.tokenizer.decode
        print(f"  turn 1 from the divergence: {dec(first.tokens[lcp : lcp + 40])!r}")
        print(f"  turn 2 from the divergence: {dec(second.tokens[lcp : lcp + 40])!r}")
    # served where its prefix is: where the session's prompt was cached between the turns (the
    # first turn's engine, or the one the planner moved its KV to), as the KV events told the gateway
    held = first.state["cached_blocks_by_engine"]
    where = {e for e, blocks in held.items() if blocks and blocks == max(held.values())}
    assert second.engine in where, (
        f"{name}: turn 2 went to {second.engine}, its prefix was on {held} "
        f"(turn 1 on {first.engine}): {state['last_decision']}"
    )
    # the pass/fail criterion: the second turn hit the prefix cache for its whole common prefix
    assert abs(cached - aligned) <= BLOCK, (name, cached, aligned, second.hits, state["last_decision"])


def test_claude_code_two_turns_through_the_gateway(
    gateway: ServedGateway,
    cluster: dict[str, LocalEngine],
    recorder: Recorder,
    tokenizer: ChatTokenizer,
    tmp_path: Path,
) -> None:
    clients = harness_clients()
    home = tmp_path / "claude"
    env = claude_env(recorder.url, home)
    commands = [
        claude_argv(clients, "say hello", MODEL),
        claude_argv(clients, "say it again", MODEL, "--continue"),
    ]
    turns = two_turns(
        "claude",
        "/v1/messages",
        anthropic_routes.parse,
        commands,
        env,
        home,
        gateway,
        recorder,
        cluster,
        tokenizer,
    )
    assert turns[0].session == turns[0].exchange.headers["x-claude-code-session-id"]
    check_second_turn("Claude Code", turns, tokenizer)

    # its compaction, sent as it sends it by default (no request-class header), is not a turn:
    # routed without the session, which keeps its two turns
    start = len(recorder.exchanges)
    run(claude_argv(clients, "/compact", MODEL, "--continue"), env, home)  # exits 0 even if it fails
    sent = recorder.since(start, "/v1/messages")
    # (the engine may refuse it first, a 400: the conversation, with the random model's long
    # answers, plus the instruction is past the context window; Claude Code then compacts less)
    statuses = [e.status for e in sent]
    assert 200 in statuses and max(statuses) < 500, [(e.status, e.error) for e in sent]
    print(f"Claude Code /compact: {statuses}; refused: {[e.error[:300] for e in sent if e.error]}")
    assert "x-claude-code-request-class" not in sent[0].headers
    assert all("x-agentgw-session" not in e.response_headers for e in sent), [
        e.response_headers for e in sent
    ]
    sid = turns[1].session
    state = httpx.get(f"{gateway.url}/v1/agent/sessions/{quote(sid, safe='')}", timeout=10).json()
    assert state["turns"] == 2, state


def test_codex_two_turns_through_the_gateway(
    gateway: ServedGateway,
    cluster: dict[str, LocalEngine],
    recorder: Recorder,
    tokenizer: ChatTokenizer,
    tmp_path: Path,
) -> None:
    clients = harness_clients()
    home = tmp_path / "codex"
    env = codex_env(recorder.url + "/v1", home)
    commands = [
        codex_argv(clients, "say hello", MODEL),
        codex_argv(clients, "say it again", MODEL, "resume", "--last"),
    ]
    turns = two_turns(
        "codex",
        "/v1/responses",
        responses_routes.parse,
        commands,
        env,
        home,
        gateway,
        recorder,
        cluster,
        tokenizer,
    )
    assert turns[0].session == turns[0].exchange.headers["thread-id"]
    check_second_turn("Codex", turns, tokenizer)
