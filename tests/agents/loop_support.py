"""What the agent-loop tests share: a recording proxy in front of the gateway that notes, around
each exchange, every engine's prefix-cache hits, the session as the session API shows it and the
serving engine's device pin; and the checks of a session's turns.

The recorder relays one request at a time, so an engine's hits during an exchange are that
request's. A harness mostly runs its loop that way (a tool runs between two turns; a subagent runs
while its parent waits for it); where two requests do overlap (Codex's parent sends its next turn,
the `wait_agent` call, while the subagent it just spawned sends its first), the later one waits
at the recorder for the earlier one's answer, and `queued` counts it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from tokenizers import Tokenizer

from gateway.analysis.tokenize import ChatTokenizer
from gateway.api import anthropic_routes, responses_routes
from gateway.local.agent_script import next_output
from gateway.local.engines import HASH_SEED
from gateway.wire.openai import ParsedRequest, parse_body
from testing.loopback_proxy import LoopbackProxy
from tests.conftest import engine_metric

BLOCK = 128
TIMEOUT_S = 300
PARSERS: dict[str, Callable[[bytes], ParsedRequest]] = {
    "/v1/messages": anthropic_routes.parse,
    "/v1/responses": responses_routes.parse,
    "/v1/chat/completions": lambda raw: parse_body("chat", raw),
}


@dataclass(frozen=True)
class EngineHandle:
    url: str
    control_url: str | None = None
    control_token: str | None = None


@dataclass
class Exchange:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    started: float
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response: bytes = b""
    ended: float = 0.0
    hits: dict[str, float] = field(default_factory=dict)
    """Each engine's prefix-cache hits (tokens) during the exchange."""
    state: dict[str, Any] | None = None
    """The session API's record right after the answer."""
    pin: dict[str, Any] | None = None
    """The serving engine's device pin of the session right after the answer (engine_ext)."""

    @property
    def route(self) -> str:
        return self.path.split("?", 1)[0]

    @property
    def session(self) -> str | None:
        return self.response_headers.get("x-agentgw-session")

    @property
    def engine(self) -> str:
        return self.response_headers["x-agentgw-engine"]


class LoopRecorder(LoopbackProxy):
    """A loopback HTTP proxy in front of the gateway (answers relayed whole once they end)."""

    def __init__(self, target: str, engines: Mapping[str, EngineHandle]) -> None:
        self.engines = dict(engines)
        self.exchanges: list[Exchange] = []
        self.queued = 0
        """Requests that arrived while another was being relayed (and waited for it)."""
        self._lock = threading.Lock()
        self._one_at_a_time = threading.Lock()
        super().__init__(target, TIMEOUT_S)

    def handle(
        self, client: BaseHTTPRequestHandler, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> None:
        if not self._one_at_a_time.acquire(blocking=False):
            with self._lock:
                self.queued += 1
            self._one_at_a_time.acquire()
        try:
            ex = self._before(method, path, headers, body)
            try:
                up = self._http.request(method, path, headers=headers, content=body)
            finally:
                self._after(ex)
            ex.status = up.status_code
            ex.response_headers = {k.lower(): v for k, v in up.headers.items()}
            ex.response = up.content
            self._observe(ex)
        finally:
            self._one_at_a_time.release()
        self.send_whole(client, up)

    def _hits(self) -> dict[str, float]:
        return {n: engine_metric(e.url, "vllm:prefix_cache_hits_total") for n, e in self.engines.items()}

    def _before(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Exchange:
        ex = Exchange(method, path, {k.lower(): v for k, v in headers.items()}, body, time.monotonic())
        ex.hits = self._hits()
        with self._lock:
            self.exchanges.append(ex)
        return ex

    def _after(self, ex: Exchange) -> None:
        after = self._hits()
        ex.hits = {n: after[n] - ex.hits[n] for n in after}
        ex.ended = time.monotonic()

    def _observe(self, ex: Exchange) -> None:
        sid = ex.session
        if sid is None or ex.status != 200:
            return
        ex.state = httpx.get(f"{self.target}/v1/agent/sessions/{quote(sid, safe='')}", timeout=10).json()
        handle = self.engines.get(ex.engine)
        if handle is not None and handle.control_url is not None:
            auth = {"Authorization": f"Bearer {handle.control_token}"} if handle.control_token else {}
            r = httpx.get(
                f"{handle.control_url}/v1/kv/sessions/{quote(sid, safe='')}", headers=auth, timeout=10
            )
            ex.pin = r.json().get("device_pin") if r.status_code == 200 else {"status": r.status_code}

    def sessions(self) -> dict[str, list[Exchange]]:
        """The generation requests by gateway session, in order."""
        out: dict[str, list[Exchange]] = {}
        for ex in self.exchanges:
            if ex.route in PARSERS and ex.session is not None:
                out.setdefault(ex.session, []).append(ex)
        return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Renderer:
    """The gateway's own rendering of a request into prompt token ids (equal to vLLM's:
    tests/gateway/test_tokenize_vllm_e2e.py), and the scripted decoder's answer to it."""

    def __init__(self, model_dir: Path) -> None:
        self.chat = ChatTokenizer(model_dir, BLOCK, HASH_SEED)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.eos = self.tokenizer.token_to_id("<|im_end|>")

    def prompt(self, ex: Exchange) -> list[int]:
        parsed = PARSERS[ex.route](ex.body)
        assert parsed.exact, ex.route
        body = parsed.prompt if parsed.prompt is not None else parsed.body
        return list(self.chat.prompt_info("chat", body).tokens)

    def output(self, prompt: list[int]) -> list[int]:
        """The token ids the scripted decoder forced for `prompt` (its answer, then EOS)."""
        text = next_output(self.tokenizer.decode(prompt, skip_special_tokens=False))
        assert text is not None, "no script in the prompt"
        return [*self.tokenizer.encode(text, add_special_tokens=False).ids, self.eos]


@dataclass(frozen=True)
class TurnCheck:
    turn: int
    engine: str
    reason: str
    prompt_tokens: int
    common_prefix: int
    """Of this turn's prompt and the previous turn's prompt."""
    reusable: int
    """Of this turn's prompt and what the previous turn left in the engine's KV cache: its prompt
    and its output (but the last token, whose KV is never computed)."""
    expected: int
    """`reusable` rounded down to whole blocks (at most prompt - 1 tokens can hit)."""
    cached: float
    """vLLM's prefix-cache hits for this turn on the engine that served it."""
    gap_s: float
    """From the previous turn's answer to this turn's request: the tool's run (or the subagent's)."""
    pinned_during_gap: bool


def check_session(name: str, turns: list[Exchange], renderer: Renderer) -> list[TurnCheck]:
    """Every turn after the first: served where the session's prefix was (the engine the gateway's
    index showed holding most of its blocks after the previous turn), with vLLM's cached tokens
    equal to the block-aligned prefix it shares with what the previous turn left cached; and the
    session pinned on that engine through the gap before it (when the engine runs engine_ext)."""
    checks = []
    prompts = [renderer.prompt(t) for t in turns]
    for k in range(1, len(turns)):
        prev, cur = turns[k - 1], turns[k]
        assert prev.state is not None and cur.state is not None
        left = prompts[k - 1] + renderer.output(prompts[k - 1])[:-1]
        reusable = common_prefix(prompts[k], left)
        expected = min(reusable, len(prompts[k]) - 1) // BLOCK * BLOCK
        held = prev.state["cached_blocks_by_engine"]
        where = {e for e, b in held.items() if b and b == max(held.values())}
        pin = prev.pin or {}
        check = TurnCheck(
            turn=k + 1,
            engine=cur.engine,
            reason=cur.response_headers.get("x-agentgw-reason", ""),
            prompt_tokens=len(prompts[k]),
            common_prefix=common_prefix(prompts[k], prompts[k - 1]),
            reusable=reusable,
            expected=expected,
            cached=cur.hits[cur.engine],
            gap_s=cur.started - prev.ended,
            pinned_during_gap=bool(pin.get("blocks")) and prev.engine == cur.engine,
        )
        print(f"{name} {check}")
        assert cur.engine in where, (name, k + 1, cur.engine, held, cur.state["last_decision"])
        assert check.cached == expected, (name, check)
        checks.append(check)
    return checks
