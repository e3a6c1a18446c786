"""Live agent sessions against peers: real Claude Code and Codex sessions, scripted, on the same 3
real engines, through agentgw and through vllm-router's policies, in one run.

    flock /tmp/agentgw-heavy.lock python -m benchmarks.agents_live \\
        --json /tmp/agents_live.json --plot docs/img/agents_live.png     # ~35 min on 2 cores

Workload: ``--sessions`` S concurrent harness sessions, Claude Code (``claude -p``) and Codex
(``codex exec``) alternately, each a scripted task for the embedded default's ``tiny-agent``
(the scripted decoder, gateway/local/scripted_decoder.py) shaped like the seed traces' agentic
sessions scaled down to the tiny engines: ``--tools`` tool calls per session, each a command
that sleeps 1-4 s (the tool gap) and then prints a file of 2-6 KB (the context grows by ~1-2K
tokens a turn), a subagent in every other session (Claude Code's ``Agent``; Codex's
``spawn_agent`` + ``wait_agent``) with two tool calls of its own, and an answer that quotes a
marker a tool read. Every command runs in the session's own scratch folder.

Targets (``--targets``), each on freshly restarted engines (vLLM's prefix cache, engine_ext's host
tier and pins all start empty), each run ``--repeats`` times:

- ``agentgw``: ``agentgw serve``'s default config for the stack (the harnesses' own session
  headers are the hints; engine_ext pins and the planner on);
- ``agentgw-no-hints``: the same gateway, with every hint header and body field stripped by the
  measuring proxy (routing on prefix hashes and load only);
- ``vr-cache-aware``: vllm-router 0.1.17 ``--policy cache_aware``;
- ``vr-consistent-hash``: ``--policy consistent_hash``, keyed on ``x-session-id``, which the
  harnesses send through their custom-header settings (Claude Code's ``ANTHROPIC_CUSTOM_HEADERS``,
  Codex's provider ``http_headers``) for this target only;
- ``vr-kv-aware``: ``--policy kv_aware`` fed by the engines' KV events (``--kv-event-source``,
  block size 128, ``--kv-aware-session-affinity-ttl-secs``);
- ``vr-round-robin``: ``--policy round_robin``.

Every target's harnesses talk to a measuring proxy (the same code for all) that relays streams
as they come and records, per request, the time to the first event that carries output (TTFT as
the harness sees it, router included). Per target and repeat: task completion time p50/p90
(each session's wall time), per-turn TTFT p50/p90, cached-token share and recomputed tokens
(the engines' ``vllm:prompt_tokens_by_source_total``), engine balance (the busiest engine's
prompt tokens over the mean), pins (engine_ext's device pins made) and KV actions (the
gateway's completed inter-turn actions, ``agentgw_migrations_total``: a pin for the tool gap
(``stay``) as well as moves, demotions, replications and releases). The table shows each figure's median over the repeats and its spread (min-max).

vllm-router comes from scripts/bench-setup.sh (``.bench-venv``); the harnesses from
scripts/setup.sh.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx

from benchmarks._common import ManagedProcess, free_port, percentile, wait_http_ok
from benchmarks.overhead import _default_vllm_router_bin
from gateway.core.hints import HEADER_NAMES, HINT_BODY_KEYS
from gateway.local.agent_script import AGENT_MODEL, Step, script_text
from gateway.local.embedded import LocalStack, start_local_stack
from gateway.local.harness import (
    MULTI_AGENT_V1,
    HarnessClients,
    claude_argv,
    claude_env,
    codex_argv,
    codex_env,
    harness_clients,
)
from testing.loopback_proxy import LoopbackProxy

TARGETS = (
    "agentgw",
    "vr-cache-aware",
    "vr-kv-aware",
    "vr-consistent-hash",
    "agentgw-no-hints",
    "vr-round-robin",
)
BLOCK = 128
SESSION_TIMEOUT_S = 900
#: The first server-sent event of an answer that carries output, per API.
_FIRST_OUTPUT = re.compile(
    rb"event: (content_block_start|response\.output_item\.added)|\"delta\": ?\{\"(content|tool_calls)\""
)
_WORDS = [
    "agent",
    "tool",
    "prefix",
    "cache",
    "engine",
    "block",
    "token",
    "session",
    "route",
    "pin",
    "turn",
    "gap",
    "store",
    "host",
    "device",
    "prefill",
    "decode",
    "request",
    "answer",
    "script",
    "marker",
    "file",
    "folder",
    "shell",
    "command",
    "read",
    "write",
    "subagent",
]


# ---------------------------------------------------------------------------------------------
# the workload


@dataclass(frozen=True)
class SessionPlan:
    index: int
    harness: str  # "claude" | "codex"
    work: Path
    steps: list[Step]
    marker: str
    subagent: bool


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        line = " ".join(rng.choice(_WORDS) for _ in range(12)) + f" {rng.randrange(10**6)}\n"
        out.append(line)
        n += len(line)
    return "".join(out)


def plan_session(index: int, root: Path, tools: int, seed: int) -> SessionPlan:
    """Session ``index``'s scratch folder (its files written) and script."""
    rng = random.Random(seed * 1000 + index)
    harness = "claude" if index % 2 == 0 else "codex"
    work = root / f"s{index}"
    work.mkdir(parents=True)
    marker = f"MARKER-{rng.getrandbits(32):08x}"
    (work / "notes.txt").write_text(f"the marker: {marker}\n")
    for k in range(tools):
        (work / f"part{k}.txt").write_text(_text(rng, rng.randrange(2000, 6000)))
    (work / "sub.txt").write_text(f"SUB-{index:04d}\n" + _text(rng, 1500))
    subagent = index % 4 in (0, 1)  # every other session of each harness

    def shell(cmd: str) -> Step:
        if harness == "claude":
            return Step(tool="Bash", args={"command": f"cd {work} && {cmd}", "description": "Run a step"})
        return Step(tool="exec_command", args={"cmd": cmd, "workdir": str(work)})

    steps = [shell(f"sleep {rng.choice((1, 2, 3, 4))} && cat part{k}.txt") for k in range(tools - 1)]
    steps.append(shell("cat notes.txt"))
    if subagent:
        sub = script_text([shell("sleep 1 && cat sub.txt"), shell("wc -l sub.txt"), Step(say="Checked.")])
        at = len(steps) // 2
        if harness == "claude":
            steps.insert(
                at,
                Step(
                    tool="Agent",
                    args={
                        "description": "Check the sub file",
                        "prompt": sub,
                        "subagent_type": "general-purpose",
                        "run_in_background": False,
                    },
                ),
            )
        else:
            wait = {"targets": ['{{find:"agent_id":\\s*"([^"]+)"}}'], "timeout_ms": SESSION_TIMEOUT_S * 1000}
            steps[at:at] = [
                Step(tool="multi_agent_v1__spawn_agent", args={"message": sub}),
                Step(tool="multi_agent_v1__wait_agent", args=wait),
            ]
    steps.append(Step(say="The marker is {{find:MARKER-[0-9a-f]+}}."))
    return SessionPlan(index, harness, work, steps, marker, subagent)


# ---------------------------------------------------------------------------------------------
# the measuring proxy


@dataclass
class Request:
    path: str
    started: float
    status: int = 0
    first_output: float | None = None
    ended: float = 0.0
    engine: str = ""


class Meter(LoopbackProxy):
    """A loopback proxy in front of a target: relays each answer as it streams, records when the
    first output event passed; with ``strip_hints`` removes every hint header and body field."""

    def __init__(self, target: str, strip_hints: bool = False) -> None:
        self.requests: list[Request] = []
        self.strip_hints = strip_hints
        self._lock = threading.Lock()
        super().__init__(target, httpx.Timeout(SESSION_TIMEOUT_S, connect=10))

    def handle(
        self, client: BaseHTTPRequestHandler, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> None:
        if self.strip_hints:
            headers = {k: v for k, v in headers.items() if k.lower() not in HEADER_NAMES}
            with contextlib.suppress(ValueError):
                doc = json.loads(body) if body else None
                if isinstance(doc, dict) and any(k in doc for k in HINT_BODY_KEYS):
                    body = json.dumps({k: v for k, v in doc.items() if k not in HINT_BODY_KEYS}).encode()
        rec = Request(path.split("?", 1)[0], time.monotonic())
        with self._lock:
            self.requests.append(rec)

        def first_output(chunk: bytes) -> None:
            if rec.first_output is None and _FIRST_OUTPUT.search(chunk):
                rec.first_output = time.monotonic()

        with self._http.stream(method, path, headers=headers, content=body) as up:
            rec.status = up.status_code
            rec.engine = up.headers.get("x-agentgw-engine", "")
            self.send_streamed(client, up, first_output)
        rec.ended = time.monotonic()


# ---------------------------------------------------------------------------------------------
# running one target


def wait_all(
    procs: list[subprocess.Popen[bytes]], timeout_s: float, poll_s: float = 0.05
) -> list[float | None]:
    """Wait for every process; each one's end time (monotonic) as it is seen to exit, ``None`` for
    one still running after ``timeout_s`` (then killed)."""
    ended: list[float | None] = [None] * len(procs)
    deadline = time.monotonic() + timeout_s
    while any(e is None for e in ended) and time.monotonic() < deadline:
        for i, proc in enumerate(procs):
            if ended[i] is None and proc.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(poll_s)
    for i, proc in enumerate(procs):
        if ended[i] is None:
            proc.kill()
            proc.wait()
    return ended


@dataclass
class RepeatResult:
    target: str
    repeat: int
    completion_s: list[float]
    completed: int
    sessions: int
    ttft_s: list[float]
    requests: int
    errors: int
    prompt_tokens: float
    cached_tokens: float
    recomputed_tokens: float
    engine_prompt_tokens: dict[str, float]
    pins: float
    moves: float
    notes: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, float]:
        c, t = sorted(self.completion_s), sorted(self.ttft_s)
        per_engine = list(self.engine_prompt_tokens.values())
        mean = statistics.fmean(per_engine) if per_engine else 0.0
        return {
            "completion_p50_s": percentile(c, 50),
            "completion_p90_s": percentile(c, 90),
            "ttft_p50_ms": percentile(t, 50) * 1000,
            "ttft_p90_ms": percentile(t, 90) * 1000,
            "cached_share": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan"),
            "recomputed_ktok": self.recomputed_tokens / 1000,
            "balance": max(per_engine) / mean if mean else float("nan"),
            "pins": self.pins,
            "moves": self.moves,
            "completed": self.completed / self.sessions,
        }


_PROM = re.compile(
    r'^(vllm:prompt_tokens_by_source_total)\{[^}]*source="([a-z_]+)"[^}]*\} ([0-9.e+]+)$', re.M
)
_MIGRATIONS = re.compile(r'^agentgw_migrations_total\{[^}]*outcome="completed"[^}]*\} ([0-9.e+]+)$', re.M)


def prompt_sources(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for _, source, value in _PROM.findall(httpx.get(url + "/metrics", timeout=10).text):
        out[source] = out.get(source, 0.0) + float(value)
    return out


def device_pins(stack: LocalStack) -> float:
    token = stack.config.get("migration", {}).get("control_token")
    total = 0.0
    for pool in stack.config["pools"]:
        for e in pool["engines"]:
            if e.get("control_url"):
                stats = httpx.get(
                    e["control_url"] + "/v1/kv/stats",
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=10,
                ).json()
                total += float((stats.get("device") or {}).get("pinned", 0))
    return total


class Target:
    """One target's router on the stack's engines (or the gateway), started and stopped."""

    def __init__(
        self, name: str, stack: LocalStack, logs: Path, router_bin: str, affinity_ttl_s: int
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        engines = [e for pool in stack.config["pools"] for e in pool["engines"]]
        if name.startswith("agentgw"):
            import yaml

            config = {**stack.config, "listen": {"host": "127.0.0.1", "port": self.port}}
            path = logs / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            argv = [sys.executable, "-m", "gateway", "serve", "--config", str(path)]
            ready = "/ready"
        else:
            if not router_bin or not Path(router_bin).exists():
                raise SystemExit(
                    "no vllm-router executable: run scripts/bench-setup.sh (or --vllm-router-bin)"
                )
            policy = {
                "vr-cache-aware": "cache_aware",
                "vr-consistent-hash": "consistent_hash",
                "vr-kv-aware": "kv_aware",
                "vr-round-robin": "round_robin",
            }[name]
            argv = [router_bin, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy]
            argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
            argv += ["--log-level", "warning", "--worker-urls", *[e["url"] for e in engines]]
            if policy == "kv_aware":
                for e in engines:
                    argv += ["--kv-event-source", f"{e['url']}={e['kv_events']}"]
                argv += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", AGENT_MODEL]
                argv += ["--kv-aware-session-affinity-ttl-secs", str(affinity_ttl_s)]
            ready = "/health"
        self.proc = ManagedProcess(name, argv, logs)
        try:
            wait_http_ok(self.url + ready, 120, self.proc.proc)
        except RuntimeError as exc:
            self.proc.stop()
            raise RuntimeError(f"{name}: {exc}\n{self.proc.log_tail()}") from None

    def moves(self) -> float:
        if not self.name.startswith("agentgw"):
            return 0.0
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(v) for v in _MIGRATIONS.findall(text))

    def stop(self) -> None:
        self.proc.stop(20)


def harness_command(
    plan: SessionPlan, clients: HarnessClients, base: str, home: Path, session_header: bool
) -> tuple[list[str], dict[str, str]]:
    prompt = "Follow the script. " + script_text(plan.steps)
    sid = f"bench-{plan.index}-{home.name}"
    if plan.harness == "claude":
        env = claude_env(base, home, small_model=AGENT_MODEL)
        if session_header:
            env["ANTHROPIC_CUSTOM_HEADERS"] = f"x-session-id: {sid}"
        argv = claude_argv(
            clients, prompt, AGENT_MODEL, "--allowedTools", "Bash", "Agent", "--permission-mode", "dontAsk"
        )
        return argv, env
    headers = {"x-session-id": sid} if session_header else None
    env = codex_env(base + "/v1", home, features=MULTI_AGENT_V1, http_headers=headers)
    return codex_argv(clients, prompt, AGENT_MODEL, "-s", "workspace-write"), env


def run_repeat(
    target: Target,
    stack: LocalStack,
    clients: HarnessClients,
    args: argparse.Namespace,
    repeat: int,
    root: Path,
) -> RepeatResult:
    meter = Meter(target.url, strip_hints=target.name == "agentgw-no-hints")
    urls = {e["name"]: e["url"] for pool in stack.config["pools"] for e in pool["engines"]}
    before = {n: prompt_sources(u) for n, u in urls.items()}
    pins0, moves0 = device_pins(stack), target.moves()
    work = root / f"{target.name}-r{repeat}"
    plans = [plan_session(i, work, args.tools, args.seed + repeat) for i in range(args.sessions)]
    procs = []
    for plan in plans:
        home = work / f"home{plan.index}"
        argv, env = harness_command(plan, clients, meter.url, home, target.name == "vr-consistent-hash")
        out = (work / f"s{plan.index}.out").open("wb")
        procs.append(
            (
                plan,
                time.monotonic(),
                out,
                subprocess.Popen(
                    argv,
                    env=env,
                    cwd=plan.work,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                ),
            )
        )
    ended = wait_all([proc for _, _, _, proc in procs], SESSION_TIMEOUT_S)
    completion, completed, notes = [], 0, []
    for (plan, started, out, proc), end in zip(procs, ended, strict=True):
        if end is None:
            notes.append(f"s{plan.index} ({plan.harness}) timed out")
            end = time.monotonic()
        completion.append(end - started)
        out.close()
        text = (work / f"s{plan.index}.out").read_text(errors="replace")
        if proc.returncode == 0 and f"The marker is {plan.marker}." in text:
            completed += 1
        else:
            notes.append(f"s{plan.index} ({plan.harness}) rc {proc.returncode}: {text[-300:]!r}")
    meter.close()
    after = {n: prompt_sources(u) for n, u in urls.items()}
    delta = {n: {k: after[n].get(k, 0.0) - before[n].get(k, 0.0) for k in after[n]} for n in urls}
    gen = [r for r in meter.requests if r.path in ("/v1/messages", "/v1/responses", "/v1/chat/completions")]
    return RepeatResult(
        target=target.name,
        repeat=repeat,
        completion_s=completion,
        completed=completed,
        sessions=len(plans),
        ttft_s=[r.first_output - r.started for r in gen if r.first_output is not None],
        requests=len(gen),
        errors=sum(1 for r in gen if r.status != 200),
        prompt_tokens=sum(sum(d.values()) for d in delta.values()),
        cached_tokens=sum(
            d.get("local_cache_hit", 0.0) + d.get("external_kv_transfer", 0.0) for d in delta.values()
        ),
        recomputed_tokens=sum(d.get("local_compute", 0.0) for d in delta.values()),
        engine_prompt_tokens={n: sum(d.values()) for n, d in delta.items()},
        pins=device_pins(stack) - pins0,
        moves=target.moves() - moves0,
        notes=notes,
    )


@contextlib.contextmanager
def fresh_stack(args: argparse.Namespace, home: Path) -> Iterator[LocalStack]:
    stack = start_local_stack(home=home, timeout_s=600)
    try:
        yield stack
    finally:
        stack.stop()


# ---------------------------------------------------------------------------------------------
# reporting

COLUMNS = (
    ("completion_p50_s", "done p50 s", "{:.1f}"),
    ("completion_p90_s", "done p90 s", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p90_ms", "TTFT p90 ms", "{:.0f}"),
    ("cached_share", "cached", "{:.3f}"),
    ("recomputed_ktok", "recomputed Ktok", "{:.1f}"),
    ("balance", "balance", "{:.2f}"),
    ("pins", "pins", "{:.0f}"),
    ("moves", "KV actions", "{:.0f}"),
    ("completed", "completed", "{:.2f}"),
)


def summarize(results: list[RepeatResult]) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per target and figure: (median, min, max) over the repeats."""
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    for name in dict.fromkeys(r.target for r in results):
        figs = [r.figures() for r in results if r.target == name]
        out[name] = {
            k: (statistics.median(f[k] for f in figs), min(f[k] for f in figs), max(f[k] for f in figs))
            for k in figs[0]
        }
    return out


def table(summary: dict[str, dict[str, tuple[float, float, float]]]) -> str:
    head = "| target | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for name, figs in summary.items():
        cells = []
        for key, _, fmt in COLUMNS:
            med, lo, hi = figs[key]
            cell = fmt.format(med)
            if lo != hi:
                cell += f" ({fmt.format(lo)}-{fmt.format(hi)})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, tuple[float, float, float]]], path: Path, caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, label) in zip(
        axes,
        (("completion_p50_s", "task completion p50 (s)"), ("ttft_p50_ms", "per-turn TTFT p50 (ms)")),
        strict=True,
    ):
        med = [summary[n][key][0] for n in names]
        err = [
            [m - summary[n][key][1] for n, m in zip(names, med, strict=True)],
            [summary[n][key][2] - m for n, m in zip(names, med, strict=True)],
        ]
        ax.bar(
            range(len(names)),
            med,
            yerr=err,
            capsize=4,
            color=["#2b6cb0" if n.startswith("agentgw") else "#a0aec0" for n in names],
        )
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
    fig.suptitle(caption, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.agents_live", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--targets", default=",".join(TARGETS), help="comma-separated, from: " + ", ".join(TARGETS)
    )
    ap.add_argument("--sessions", type=int, default=4, help="concurrent harness sessions (S)")
    ap.add_argument("--tools", type=int, default=6, help="tool calls per session besides the subagent's")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--affinity-ttl", type=int, default=300, help="vr-kv-aware's session-affinity TTL (s)")
    ap.add_argument("--vllm-router-bin", default=_default_vllm_router_bin())
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the scratch folders and logs")
    ap.add_argument("--from-json", type=Path, help="only print the table (and --plot) of a run's --json")
    args = ap.parse_args(argv)
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        runs = [RepeatResult(**r) for r in doc["runs"]]
        summary = summarize(runs)
        print(table(summary))
        if args.plot:
            plot(summary, args.plot, doc["caption"])
        return 0
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        ap.error(f"unknown targets {sorted(unknown)}")
    clients = harness_clients()
    root = Path(tempfile.mkdtemp(prefix="agentgw-agents-live-"))
    results: list[RepeatResult] = []
    started = time.monotonic()
    caption = (
        f"{args.sessions} concurrent sessions (Claude Code and Codex, scripted tiny-agent), "
        f"{args.tools} tool calls each, {args.repeats} repeats; 3 engines on 2 CPU cores"
    )

    def save() -> None:  # after every repeat: a run cut short still has its figures
        if args.json:
            doc = {
                "args": {k: str(v) for k, v in vars(args).items()},
                "caption": caption,
                "wall_s": time.monotonic() - started,
                "runs": [asdict(r) for r in results],
            }
            args.json.write_text(json.dumps(doc, indent=1))

    try:
        for name in targets:
            with fresh_stack(args, root / f"stack-{name}") as stack:  # engines restarted per target
                target = Target(
                    name, stack, root / f"stack-{name}" / "logs", args.vllm_router_bin, args.affinity_ttl
                )
                try:
                    for r in range(args.repeats):
                        res = run_repeat(target, stack, clients, args, r, root)
                        results.append(res)
                        save()
                        figs = res.figures()
                        print(
                            f"{name} repeat {r}: "
                            + ", ".join(f"{k} {v:.3g}" for k, v in figs.items())
                            + (f"; {res.notes}" if res.notes else ""),
                            flush=True,
                        )
                finally:
                    target.stop()
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    wall = time.monotonic() - started
    summary = summarize(results)
    save()
    print(f"\n{caption}; run {wall / 60:.1f} min\n")
    print(table(summary))
    if args.plot:
        plot(summary, args.plot, caption)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
