"""The checks of scripts/compose-check.sh against docker-compose.yml's running ``cpu`` and
``replicas`` profiles.

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

``replicas``: the ``replicas`` profile, up with the ``cpu`` one (3 gateway replicas sharing Redis
behind the compose file's nginx, keys required); through nginx, 4 hinted sessions of 4 turns,
interleaved, with a replica stopped (``docker stop``) after the second round:

1. a request without a key is refused (401); nginx spread the sessions' turns over all 3
   replicas: its access log's upstream of each request (found by its ``X-Request-Id``) is the
   ``X-Upstream-Addr`` the client got, and each replica's own ``agentgw_requests_total`` grew by
   the requests the log gives it;
2. every later turn of a session was routed ``sticky`` to the engine of its first turn (the
   replicas' ``agentgw_route_decisions_total{reason="sticky"}`` grew by the later turns each
   served), and every replica's session API (``GET /v1/agent/sessions/{id}``) gives that home
   and the session's turn count, wherever the turns went;
3. every later turn has cached prompt tokens, among them second turns that nginx sent to another
   replica than the first;
4. after the stop no request reaches the stopped replica, none fails: nginx sent at least one to
   it, found it gone and resent it to another (two upstreams in the log line); the stopped
   replica's sessions go on through the others, on their homes, with cached tokens;
5. the profile's containers stop cleanly (``docker-compose stop``: exit code 0 each, the stopped
   replica's too), are removed, and the ``cpu`` gateway still answers ``/ready``.

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
from dataclasses import dataclass
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
PROFILES = ("--profile", "cpu", "--profile", "replicas")
REPLICAS = ("replica0", "replica1", "replica2")
FLEET = (*REPLICAS, "balancer")
CHAT = "/v1/chat/completions"
NGINX_LOG = "/tmp/agentgw-nginx/access.log"  # the balancer container's (deploy/launch.py)
READY_TIMEOUT_S = float(os.environ.get("COMPOSE_CHECK_READY_TIMEOUT_S", "900"))
_HITS = re.compile(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)
_SUCCESS = re.compile(r"^vllm:request_success_total(?:\{[^}]*\})? ([0-9.e+]+)$", re.M)
_SAMPLE = re.compile(r"^(agentgw_requests_total|agentgw_route_decisions_total)\{([^}]*)\} ([0-9.e+]+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_ACCESS = re.compile(r"rid=(\S+) upstream=(.*?) upstream_status=(.*?) rt=")


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
            "AGENTGW_REPLICA_PORT_BASE": base + 305,  # replicas profile: +305..+307
            "AGENTGW_BALANCER_PORT": base + 308,
        }
        wanted = [base + off + i for off in (0, 100, 200) for i in range(len(ENGINES))]
        wanted += [base + 300 + i for i in range(9)]
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
        base = int(os.environ.get("AGENTGW_REPLICA_PORT_BASE") or 8010)
        self.replicas = [f"{HOST}:{base + i}" for i in range(len(REPLICAS))]
        self.balancer = f"http://{HOST}:{os.environ.get('AGENTGW_BALANCER_PORT') or 8080}"
        self.key = os.environ.get("AGENTGW_API_KEY", "")
        self.admin = {"authorization": f"Bearer {os.environ.get('AGENTGW_ADMIN_KEY', '')}"}

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

    def compose(self, *args: str) -> str:
        return subprocess.run(
            ["docker-compose", *PROFILES, *args], check=True, capture_output=True, text=True
        ).stdout

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-a", "-q", service).split()
        expect(len(ids) == 1, f"one container for {service} expected, got {ids}")
        return ids[0]

    def inspect(self, cid: str, fmt: str) -> str:
        return subprocess.run(
            ["docker", "inspect", "-f", fmt, cid], check=True, capture_output=True, text=True
        ).stdout.strip()

    def kill(self, service: str) -> None:
        subprocess.run(["docker", "kill", self.container(service)], check=True, capture_output=True)

    def start(self, service: str) -> str:
        """Start the service's container again unless its restart policy did; says which."""
        cid = self.container(service)
        state = self.inspect(cid, "{{.State.Status}}")
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

    # ---- the replicas profile ----

    def wait_replicas(self) -> None:
        """Until every replica is ready and sees every engine healthy, and nginx answers."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = [f"http://{a}/ready" for a in self.replicas] + [f"{self.balancer}/health"]
        while pending and time.monotonic() < deadline:
            pending = [u for u in pending if not self.answers(u)]
            if pending:
                time.sleep(1)
        expect(not pending, f"not ready after {READY_TIMEOUT_S:.0f} s: {pending}")
        for addr in self.replicas:
            while time.monotonic() < deadline:
                metrics = self.http.get(f"http://{addr}/metrics", headers=self.admin).text
                if all(f'agentgw_engine_healthy{{engine="{n}"}} 1.0' in metrics for n in ENGINES):
                    break
                time.sleep(1)
            else:
                raise CheckFailed(f"replica {addr} does not see every engine healthy")

    def replica_counters(self, addr: str) -> tuple[float, float]:
        """The replica's own counts: chat completions answered 200, routing decisions ``sticky``."""
        r = self.http.get(f"http://{addr}/metrics", headers=self.admin)
        expect(r.status_code == 200, f"{addr}/metrics with the admin key: {r.status_code}")
        served = sticky = 0.0
        for name, labels, value in _SAMPLE.findall(r.text):
            lab = dict(_LABEL.findall(labels))
            if name == "agentgw_requests_total" and lab.get("route") == CHAT and lab.get("status") == "200":
                served += float(value)
            elif name == "agentgw_route_decisions_total" and lab.get("reason") == "sticky":
                sticky += float(value)
        return served, sticky

    def access_log(self, rids: list[str]) -> dict[str, list[str]]:
        """nginx's access log in the balancer container, in order: request id -> the upstreams it
        tried; once it holds ``rids`` (nginx writes a line when it has sent the response)."""
        cid = self.container("balancer")
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run(
                ["docker", "exec", cid, "cat", NGINX_LOG], check=True, capture_output=True, text=True
            ).stdout
            log = {rid: ups.split(", ") for rid, ups, _status in _ACCESS.findall(out)}
            if all(r in log for r in rids) or time.monotonic() > deadline:
                return log
            time.sleep(0.2)

    def session(self, addr: str, session: str) -> dict[str, Any]:
        r = self.http.get(
            f"http://{addr}/v1/agent/sessions/{session}", headers={"authorization": f"Bearer {self.key}"}
        )
        expect(r.status_code == 200, f"{addr}: GET /v1/agent/sessions/{session}: {r.status_code} {r.text}")
        body: dict[str, Any] = r.json()
        return body


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


@dataclass(frozen=True)
class Turn:
    session: str
    index: int
    rid: str
    engine: str
    reason: str
    upstream: str
    """nginx's ``X-Upstream-Addr``: the replicas it tried, the last one answered."""
    cached: int

    @property
    def replica(self) -> str:
        return self.upstream.split(", ")[-1]


def replicas_check(stack: Stack) -> None:
    t0 = time.monotonic()
    stack.wait_replicas()
    restarts = {svc: stack.inspect(stack.container(svc), "{{.RestartCount}}") for svc in FLEET}
    print(
        f"compose_check: {len(REPLICAS)} replicas and nginx ready after {time.monotonic() - t0:.0f} s "
        f"(container restarts {restarts})",
        flush=True,
    )
    bare = stack.http.post(
        f"{stack.balancer}{CHAT}", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    expect(bare.status_code == 401, f"a request without a key through nginx: {bare.status_code}, not 401")
    client = OpenAI(base_url=f"{stack.balancer}/v1", api_key=stack.key, max_retries=0, timeout=120)
    rng = random.Random(29)
    tag = f"compose-replicas-{os.getpid()}"
    # 4 sessions over 3 replicas, interleaved: round robin sends a session's next turn elsewhere
    sessions = [f"{tag}-s{i}" for i in range(4)]
    history = {s: [{"role": "system", "content": system_prompt(rng)}] for s in sessions}
    turns: dict[str, list[Turn]] = {s: [] for s in sessions}

    def play(index: int) -> list[Turn]:
        done = []
        for s in sessions:
            history[s].append({"role": "user", "content": f"Turn {index}: run the tests and fix what fails."})
            rid = f"{s}-t{index}"
            completion, headers = chat(
                client,
                history[s],
                extra_body={"agent_hints": {"session_id": s, "turn_index": index}},
                extra_headers={"x-request-id": rid},
            )
            expect(headers.get("x-request-id") == rid, f"{rid}: request id header, got {headers}")
            expect(headers.get("x-agentgw-session") == s, f"{rid}: session header, got {headers}")
            history[s].append({"role": "assistant", "content": completion.choices[0].message.content or "ok"})
            turn = Turn(
                s,
                index,
                rid,
                headers.get("x-agentgw-engine", ""),
                headers.get("x-agentgw-reason", ""),
                headers.get("x-upstream-addr", ""),
                cached_tokens(completion),
            )
            expect(turn.engine in ENGINES, f"{rid}: engine header, got {headers}")
            expect(turn.replica in stack.replicas, f"{rid}: X-Upstream-Addr {turn.upstream!r}")
            turns[s].append(turn)
            done.append(turn)
        return done

    def account(
        played: list[Turn], log: dict[str, list[str]], before: dict[str, tuple[float, float]]
    ) -> None:
        """nginx's log agrees with what the client got, each replica's own counters with the log."""
        for t in played:
            expect(
                log.get(t.rid) == t.upstream.split(", "),
                f"{t.rid}: nginx logged upstreams {log.get(t.rid)}, the client got {t.upstream!r}",
            )
        for addr, (served0, sticky0) in before.items():
            served, sticky = stack.replica_counters(addr)
            mine = [t for t in played if t.replica == addr]
            later = sum(1 for t in mine if t.index > 0)
            expect(
                served - served0 == len(mine),
                f"{addr}: agentgw_requests_total grew {served - served0}, nginx's log gives it {len(mine)}",
            )
            expect(
                sticky - sticky0 == later,
                f"{addr}: sticky decisions grew {sticky - sticky0}, it served {later} later turns",
            )

    def on_home(played: list[Turn]) -> None:
        for t in played:
            first = turns[t.session][0]
            if t.index == 0:
                expect(t.reason != "sticky", f"{t.rid}: a first turn routed {t.reason}")
                continue
            expect(
                t.engine == first.engine and t.reason == "sticky",
                f"{t.rid}: on {t.engine} ({t.reason}), the session's home is {first.engine}",
            )
            expect(t.cached >= BLOCK, f"{t.rid}: {t.cached} cached prompt tokens")

    def homes_agree(live: list[str], n: int) -> None:
        """Every live replica's session API: the home of the first turn, n turns (shared in Redis)."""
        for s in sessions:
            want = (turns[s][0].engine, n)
            for addr in live:
                deadline = time.monotonic() + 30
                got = stack.session(addr, s)
                while (got["home_engine"], got["turns"]) != want and time.monotonic() < deadline:
                    time.sleep(0.2)
                    got = stack.session(addr, s)
                expect(
                    (got["home_engine"], got["turns"]) == want,
                    f"{addr}: session {s} home {got['home_engine']}, {got['turns']} turns; want {want}",
                )

    # ---- two rounds on 3 replicas ----
    before = {a: stack.replica_counters(a) for a in stack.replicas}
    played = play(0) + play(1)
    log = stack.access_log([t.rid for t in played])
    account(played, log, before)
    spread = {a: sum(1 for t in played if t.replica == a) for a in stack.replicas}
    expect(all(spread.values()), f"nginx did not spread the turns over every replica: {spread}")
    on_home(played)
    crossed = [s for s in sessions if turns[s][1].replica != turns[s][0].replica]
    expect(bool(crossed), "no second turn went to another replica than its first")
    homes_agree(stack.replicas, 2)
    print(
        f"compose_check: through nginx, turns per replica {spread}; sessions' homes "
        f"{[turns[s][0].engine for s in sessions]}, every later turn sticky with cached tokens "
        f"{[t.cached for t in played if t.index > 0]}; {len(crossed)} second turns on another replica",
        flush=True,
    )

    # ---- a replica stopped: the one that served session 0's last turn ----
    victim = turns[sessions[0]][-1].replica
    service = REPLICAS[stack.replicas.index(victim)]
    its = [s for s in sessions if any(t.replica == victim for t in turns[s])]  # session 0 at least
    live = [a for a in stack.replicas if a != victim]
    before = {a: stack.replica_counters(a) for a in live}
    logged = len(log)
    cid = stack.container(service)
    subprocess.run(["docker", "stop", cid], check=True, capture_output=True)
    code = stack.inspect(cid, "{{.State.Status}} {{.State.ExitCode}}")
    expect(code == "exited 0", f"{service} after docker stop: {code} (a clean stop exits 0)")
    expect(not stack.answers(f"http://{victim}/health"), f"{service} still answers after docker stop")
    played = play(2) + play(3)
    log = stack.access_log([t.rid for t in played])
    account(played, log, before)
    expect(all(t.replica != victim for t in played), f"a request answered by the stopped {service}")
    after = list(log.values())[logged:]
    skipped = [ups for ups in after if ups[0] == victim and len(ups) > 1 and ups[-1] in live]
    expect(bool(skipped), f"nginx sent nothing to the stopped {victim} and on to another: {after}")
    on_home(played)  # every session's later turns, those of the stopped replica's sessions among them
    homes_agree(live, 4)
    print(
        f"compose_check: {service} stopped (exit 0); nginx resent {len(skipped)} request(s) it "
        f"found gone; its sessions {len(its)} went on on their homes, turns per replica "
        f"{ {a: sum(1 for t in played if t.replica == a) for a in live} }, cached tokens "
        f"{[t.cached for t in played]}",
        flush=True,
    )

    # ---- the profile down: a clean stop of each container (nginx first: it depends on the
    # replicas), then removed; the cpu profile keeps running ----
    stack.compose("stop", *FLEET)
    codes = {svc: stack.inspect(stack.container(svc), "{{.State.ExitCode}}") for svc in FLEET}
    expect(set(codes.values()) == {"0"}, f"exit codes after docker-compose stop: {codes}")
    stack.compose("rm", "-f", *FLEET)
    left = stack.compose("ps", "-a", "-q", *FLEET).split()
    expect(not left, f"containers of the replicas profile left after rm: {left}")
    expect(stack.http.get(f"{stack.gateway}/ready").status_code == 200, "the cpu gateway's /ready after")
    print(f"compose_check: replicas profile stopped (exit codes {codes}) and removed", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="compose_check.py")
    parser.add_argument("command", choices=["ports", "check", "replicas"])
    args = parser.parse_args(argv)
    if args.command == "ports":
        for key, value in pick_ports(random.Random()).items():
            print(f"export {key}={value}")
        return 0
    try:
        (check if args.command == "check" else replicas_check)(Stack())
    except CheckFailed as exc:
        print(f"compose_check: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"compose_check: all {args.command} checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
