"""The checks of scripts/compose-check.sh against docker-compose.yml's running ``cpu`` profile.

``ports``: print the host variables (``AGENTGW_*``) of a port layout whose ports are all free now.
``check``: with those variables set and the stack up, wait until the gateway and every engine are
ready, then check through the gateway, raising :class:`CheckFailed` at the first miss:

1. an OpenAI SDK chat completes;
2. a 5-turn hinted session (``agent_hints.session_id``) stays on one engine (a warm one when the
   layout has a first-turn pool), and from turn 2 vLLM reports cached prompt tokens
   (``usage.prompt_tokens_details.cached_tokens``) that the engine's own
   ``vllm:prefix_cache_hits_total`` counter accounts for;
3. with that engine's container killed (``docker kill``), the session's next turn and a new chat
   are served by another engine and ``/ready`` still answers 200;
4. the killed container started again (``docker start``, unless its restart policy already did),
   the gateway sees the engine healthy again and routes new sessions to it, which it serves
   (its own ``vllm:request_success_total`` grows).

The engines are those of ``agentgw serve``'s default layout (``gateway.local.layout``), as
docker-compose.yml runs them (``AGENTGW_FIRST_TURN_ENGINES`` splits them as in the file).

Needs the ``openai`` and ``httpx`` packages (the project's dev extra) and the docker CLI.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
from openai import OpenAI

from gateway.local.layout import resolve

HOST = "127.0.0.1"
MODEL = "tiny-llama"
LAYOUT = resolve(
    first_turn=int(os.environ["AGENTGW_FIRST_TURN_ENGINES"])
    if os.environ.get("AGENTGW_FIRST_TURN_ENGINES")
    else None
)
ENGINES = tuple(LAYOUT.names)
BLOCK = 128  # vLLM CPU block size: cached tokens come in whole blocks
READY_TIMEOUT_S = float(os.environ.get("COMPOSE_CHECK_READY_TIMEOUT_S", "900"))
_HITS = re.compile(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)
_SUCCESS = re.compile(r"^vllm:request_success_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)


class CheckFailed(AssertionError):
    pass


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


# ---- ports ----


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def pick_ports(rng: random.Random) -> dict[str, int]:
    """A layout (deploy/launch.py's offsets) below the ephemeral range, every port free now."""
    for _ in range(200):
        base = rng.randrange(24000, 31000, 10)  # engines on base+0..2, +100.., +200..
        layout = {
            "AGENTGW_ENGINE_PORT_BASE": base,
            "AGENTGW_PORT": base + 300,
            "AGENTGW_REDIS_PORT": base + 301,
            "AGENTGW_MOONCAKE_PORT": base + 302,  # and +303, +304
        }
        wanted = [base + off + i for off in (0, 100, 200) for i in range(len(ENGINES))]
        wanted += [base + 300 + i for i in range(5)]
        if all(_free(p) for p in wanted):
            return layout
    raise SystemExit("compose_check: no free port layout found")


# ---- the running stack ----


class Stack:
    def __init__(self) -> None:
        self.base = int(os.environ["AGENTGW_ENGINE_PORT_BASE"])
        self.gateway = f"http://{HOST}:{os.environ['AGENTGW_PORT']}"
        self.http = httpx.Client(timeout=60)
        self.project = os.environ.get("COMPOSE_PROJECT_NAME", "")

    def engine_url(self, name: str) -> str:
        return f"http://{HOST}:{self.base + ENGINES.index(name)}"

    def answers(self, url: str) -> bool:
        try:
            return self.http.get(url, timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = [f"{self.engine_url(n)}/health" for n in ENGINES] + [f"{self.gateway}/ready"]
        while pending and time.monotonic() < deadline:
            pending = [u for u in pending if not self.answers(u)]
            if pending:
                time.sleep(2)
        expect(not pending, f"not ready after {READY_TIMEOUT_S:.0f} s: {pending}")
        # the gateway admits an engine after its own probe: wait until it sees all three
        while time.monotonic() < deadline:
            metrics = self.http.get(f"{self.gateway}/metrics").text
            if all(f'agentgw_engine_healthy{{engine="{n}"}} 1.0' in metrics for n in ENGINES):
                return
            time.sleep(1)
        raise CheckFailed("the gateway does not see every engine healthy")

    def prefix_hits(self, name: str) -> float:
        found = _HITS.findall(self.http.get(f"{self.engine_url(name)}/metrics").text)
        expect(len(found) == 1, f"{name}: one vllm:prefix_cache_hits_total sample expected, got {found}")
        return float(found[0])

    def served(self, name: str) -> float:
        """The engine's own count of finished requests (every finish reason)."""
        return sum(float(v) for v in _SUCCESS.findall(self.http.get(f"{self.engine_url(name)}/metrics").text))

    def container(self, service: str) -> str:
        ids = subprocess.run(
            ["docker-compose", "--profile", "cpu", "ps", "-a", "-q", service],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        expect(len(ids) == 1, f"one container for {service} expected, got {ids}")
        return ids[0]

    def kill(self, service: str) -> None:
        subprocess.run(["docker", "kill", self.container(service)], check=True, capture_output=True)

    def start(self, service: str) -> str:
        """Start the service's container again unless its restart policy did; says which."""
        cid = self.container(service)
        state = subprocess.run(
            ["docker", "inspect", "-f", "{{.State.Status}}", cid], check=True, capture_output=True, text=True
        ).stdout.strip()
        if state in ("running", "restarting"):
            return f"restarted by its policy ({state})"
        subprocess.run(["docker", "start", cid], check=True, capture_output=True)
        return f"docker start (was {state})"

    def wait_engine(self, name: str, healthy: bool) -> None:
        """Until the gateway's probe sees ``name`` healthy (or not)."""
        want = f'agentgw_engine_healthy{{engine="{name}"}} {1.0 if healthy else 0.0}'
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if want in self.http.get(f"{self.gateway}/metrics").text:
                return
            time.sleep(1)
        raise CheckFailed(f"the gateway does not see {name} {'healthy' if healthy else 'down'}")


# ---- the checks ----


def system_prompt(rng: random.Random, words: int = 700) -> str:
    text = "the gateway routes each turn of a session to the engine that holds its prefix cache "
    text += "agents call tools read files write patches run tests and wait for results"
    vocab = text.split(" ")
    return "You are a coding agent. " + " ".join(rng.choice(vocab) for _ in range(words))


def chat(client: OpenAI, messages: list[dict[str, str]], **extra: Any) -> tuple[Any, dict[str, str]]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, **extra
    )
    completion = raw.parse()
    expect(len(completion.choices) == 1, "one choice")
    expect(isinstance(completion.choices[0].message.content, str), "an assistant message")
    expect(completion.usage is not None and completion.usage.completion_tokens > 0, "completion tokens")
    return completion, dict(raw.headers)


def cached_tokens(completion: Any) -> int:
    details = completion.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def check(stack: Stack) -> None:
    t0 = time.monotonic()
    stack.wait_ready()
    print(
        f"compose_check: gateway and {len(ENGINES)} engines ready after {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    client = OpenAI(base_url=f"{stack.gateway}/v1", api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(13)

    completion, headers = chat(client, [{"role": "user", "content": "Say hello."}])
    expect(headers.get("x-agentgw-engine") in ENGINES, f"an engine header, got {headers}")
    print(f"compose_check: SDK chat ok on {headers['x-agentgw-engine']}", flush=True)

    session = f"compose-check-{os.getpid()}"
    history = [{"role": "system", "content": system_prompt(rng)}]
    engines: list[str] = []
    cached: list[int] = []
    hits_before: dict[str, float] = {}
    for turn in range(5):
        history.append({"role": "user", "content": f"Turn {turn}: run the tests and fix what fails."})
        hints = {"agent_hints": {"session_id": session, "turn_index": turn}}
        if turn == 0:
            hits_before = {n: stack.prefix_hits(n) for n in ENGINES}
        completion, headers = chat(client, history, extra_body=hints)
        expect(headers.get("x-agentgw-session") == session, f"turn {turn}: session header, got {headers}")
        engines.append(headers["x-agentgw-engine"])
        cached.append(cached_tokens(completion))
        history.append({"role": "assistant", "content": completion.choices[0].message.content or "ok"})
    home = engines[0]
    print(f"compose_check: session turns on {engines}, cached prompt tokens {cached}", flush=True)
    if LAYOUT.first_turn:
        expect(LAYOUT.role(home) == "warm", f"a short first turn goes to the warm pool, went to {home}")
    expect(set(engines) == {home}, f"every turn of the session on one engine (sticky), got {engines}")
    expect(all(c >= BLOCK for c in cached[1:]), f"prefix-cache hits from turn 2, got {cached}")
    delta = stack.prefix_hits(home) - hits_before[home]
    expect(
        delta >= sum(cached[1:]), f"{home}'s vllm:prefix_cache_hits_total grew {delta}, < {sum(cached[1:])}"
    )
    print(f"compose_check: {home} vllm:prefix_cache_hits_total +{delta:.0f}", flush=True)

    stack.kill(home)
    expect(not stack.answers(f"{stack.engine_url(home)}/health"), f"{home} still answers after docker kill")
    history.append({"role": "user", "content": "Turn 5: and now?"})
    completion, headers = chat(
        client, history, extra_body={"agent_hints": {"session_id": session, "turn_index": 5}}
    )
    after = headers["x-agentgw-engine"]
    expect(
        after != home and after in ENGINES, f"the session's next turn served by another engine, got {after}"
    )
    completion, headers = chat(client, [{"role": "user", "content": "Still there?"}])
    expect(headers["x-agentgw-engine"] != home, f"a new chat avoids the killed {home}")
    expect(stack.http.get(f"{stack.gateway}/ready").status_code == 200, "/ready after the kill")
    print(
        f"compose_check: {home} killed; session continued on {after}, new chat on {headers['x-agentgw-engine']}",
        flush=True,
    )

    t1 = time.monotonic()
    how = stack.start(home)
    stack.wait_engine(home, healthy=True)
    print(
        f"compose_check: {home} back ({how}), healthy in the gateway after {time.monotonic() - t1:.0f} s",
        flush=True,
    )
    served_before = stack.served(home)
    landed: list[str] = []
    for i in range(2 * len(ENGINES)):  # new sessions spread over the engines: one reaches the idle one
        completion, headers = chat(
            client,
            [
                {"role": "system", "content": system_prompt(rng)},
                {"role": "user", "content": f"New task {i}."},
            ],
            extra_body={"agent_hints": {"session_id": f"{session}-after-{i}", "turn_index": 0}},
        )
        landed.append(headers["x-agentgw-engine"])
        if landed[-1] == home:
            break
    expect(landed[-1] == home, f"no new session reached the restarted {home}: {landed}")
    grew = stack.served(home) - served_before
    expect(grew >= 1, f"{home}'s vllm:request_success_total grew {grew} after serving a session")
    expect(stack.http.get(f"{stack.gateway}/ready").status_code == 200, "/ready after the restart")
    print(f"compose_check: {home} serves again (new sessions on {landed}, its requests +{grew:.0f})")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="compose_check.py")
    parser.add_argument("command", choices=["ports", "check"])
    args = parser.parse_args(argv)
    if args.command == "ports":
        for key, value in pick_ports(random.Random()).items():
            print(f"export {key}={value}")
        return 0
    try:
        check(Stack())
    except CheckFailed as exc:
        print(f"compose_check: FAILED: {exc}", file=sys.stderr)
        return 1
    print("compose_check: all checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
