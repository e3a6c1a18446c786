"""Gateway replicas behind a real load balancer, live: one replica against N behind Debian's nginx
(round robin, no stickiness, ``proxy_next_upstream error timeout http_503 non_idempotent``:
testing/replicas.py), on the same real engines, sharing one real redis-server, each replica
subscribed to every engine's KV events, tenant keys required.

    python -m benchmarks.replicas                      # 3 engines, 3 replicas, 3 repeats
    python -m benchmarks.replicas --kill               # plus a replay with a replica killed mid-run

Each repeat replays the same agentic trace (``benchmarks.live_replay``: Weka plays scaled to the
tiny model, hints in the body) twice with fresh prompt salts: straight to replica r0 (one
replica), then through nginx over all of them. Reported per run: the cached-token share (cached /
input tokens from the answers' usage), TTFT p50/p90, P90 interactivity, errors, how many later
turns went to another replica than the turn before (the balancer does spread sessions), and how
many later turns were routed as a session's first (their replica did not know the session: must
be 0). The verdict is on the medians: the balancer's cached-token share within ``--tolerance``
(2 points) of one replica's.

``--kill``: one more replay through nginx in which replica r{N-1} is SIGKILLed once a third of the
requests are done; reported: streams cut mid-way (started on an engine), requests nginx retried on
another replica, requests lost before reaching an engine (must be 0).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import default_weka_traces, one_pool_config
from benchmarks.live_replay import LiveConfig, LiveMetrics, LiveRecord, load_trace, run_live
from benchmarks.soak import Redis
from gateway.sim.traces import Play

FIRST_TURN_REASONS = {"new_session", "subagent_parent"}
KEY, ADMIN = "bench-replicas-key", "bench-replicas-admin"


def later_turns(records: Sequence[LiveRecord]) -> list[tuple[LiveRecord, LiveRecord]]:
    by: dict[str, list[LiveRecord]] = {}
    for r in sorted(records, key=lambda r: r.t_arrive):
        by.setdefault(r.session_id, []).append(r)
    return [p for turns in by.values() for p in itertools.pairwise(turns)]


def session_stats(records: Sequence[LiveRecord]) -> dict[str, int]:
    pairs = [(a, b) for a, b in later_turns(records) if not a.error and not b.error]
    return {
        "later_turns": len(pairs),
        "crossed_replica": sum(1 for a, b in pairs if a.replica != b.replica),
        "unknown_session": sum(1 for _, b in pairs if b.reason in FIRST_TURN_REASONS),
        "sticky_moved": sum(1 for a, b in pairs if b.reason == "sticky" and a.engine != b.engine),
    }


def row(label: str, m: LiveMetrics, s: dict[str, int]) -> str:
    return (
        f"| {label} | {m.requests} | {m.errors} | {m.hit_rate:.1%} | {m.ideal_hit_rate:.1%} | "
        f"{m.ttft_p50_ms:.0f} / {m.ttft_p90_ms:.0f} | {m.interactivity_p90:.1f} | "
        f"{s['crossed_replica']} / {s['later_turns']} | {s['unknown_session']} | {s['sticky_moved']} |"
    )


HEAD = (
    "| run | requests | errors | cached share | ideal | TTFT p50 / p90 ms | P90 tok/s | "
    "later turns on another replica | routed as new | sticky but moved |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=None, help="Weka folder (default: shared/traces/weka)")
    ap.add_argument("--plays", default="6")
    ap.add_argument("--max-requests", type=int, default=20)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--speedup", type=float, default=10.0)
    ap.add_argument("--lanes", type=int, default=3)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--kill", action="store_true", help="also a replay with a replica killed mid-run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from gateway.local.embedded import DEFAULT_HOME
    from gateway.local.engines import EngineSpec, free_ports, start_engines
    from gateway.local.tiny_model import build_tiny_model
    from testing.replicas import GatewayReplica, Nginx

    plays: list[Play] = load_trace(
        args.trace or default_weka_traces(),
        args.plays,
        args.max_requests,
        scale=True,
        max_context=args.max_context,
        max_output=args.max_output,
    )
    n_req = sum(len(p.requests) for p in plays)
    print(f"trace: {len(plays)} plays, {n_req} requests", flush=True)
    work = Path(tempfile.mkdtemp(prefix="agentgw-replicas-"))
    model_dir = build_tiny_model(DEFAULT_HOME / "models" / "tiny-llama", "llama")
    ports = free_ports(2 * args.engines + 1)
    specs = [
        EngineSpec(
            name=f"engine{i}",
            model_dir=model_dir,
            served_model_name="tiny-llama",
            port=ports[2 * i],
            kv_events_port=ports[2 * i + 1],
            log_path=work / f"engine{i}.log",
            max_model_len=args.max_context + args.max_output + 128,
        )
        for i in range(args.engines)
    ]
    redis = Redis(ports[-1], work / "redis.log")
    print(
        f"starting {args.engines} engines, redis, {args.replicas} replicas, nginx (logs in {work})",
        flush=True,
    )
    engines = start_engines(specs, timeout_s=600)
    replicas: list[GatewayReplica] = []
    nginx: Nginx | None = None
    report: dict[str, Any] = {"args": vars(args), "runs": []}
    try:
        redis.start()
        config = one_pool_config(
            specs,
            model_dir,
            sessions={"backend": "redis", "redis_url": f"redis://127.0.0.1:{redis.port}/0"},
            auth={
                "tenants": [{"name": "bench", "key_env": ["AGENTGW_BENCH_KEY"]}],
                "admin_key_env": ["AGENTGW_BENCH_ADMIN"],
            },
        )
        env = {"AGENTGW_BENCH_KEY": KEY, "AGENTGW_BENCH_ADMIN": ADMIN}
        replicas = [GatewayReplica(f"r{i}", config, work, env) for i in range(args.replicas)]
        threads = [threading.Thread(target=r.start) for r in replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in replicas:
            r.wait_ready()
        nginx = Nginx(work / "nginx", [r.addr for r in replicas]).start()
        urls = [s.url for s in specs]
        rng = random.Random()

        def replay(url: str, label: str) -> tuple[LiveMetrics, list[LiveRecord]]:
            cfg = LiveConfig(
                url=url,
                speedup=args.speedup,
                lanes=args.lanes,
                salt=rng.randrange(1 << 30),
                progress=False,
                api_key=KEY,
            )
            m, recs = run_live(plays, cfg, urls, label=label)
            s = session_stats(recs)
            report["runs"].append({"label": label, "metrics": m.as_dict(), "sessions": s})
            print(row(label, m, s), flush=True)
            return m, recs

        print(HEAD)
        one: list[float] = []
        many: list[float] = []
        unknown = 0
        for k in range(args.repeats):
            m1, _ = replay(replicas[0].url, f"1 replica #{k + 1}")
            mn, recs = replay(nginx.url, f"{args.replicas} behind nginx #{k + 1}")
            one.append(m1.hit_rate)
            many.append(mn.hit_rate)
            unknown += session_stats(recs)["unknown_session"]
        d = statistics.median(many) - statistics.median(one)
        ok = abs(d) <= args.tolerance and unknown == 0
        print(
            f"\nmedian cached share: 1 replica {statistics.median(one):.1%}, {args.replicas} behind nginx "
            f"{statistics.median(many):.1%} ({d * 100:+.1f} points; tolerance {args.tolerance * 100:.0f}); "
            f"later turns routed as new: {unknown} -> {'PASS' if ok else 'FAIL'}",
            flush=True,
        )
        report["median"] = {"one": statistics.median(one), "many": statistics.median(many), "ok": ok}

        if args.kill:
            victim = replicas[-1]
            done: dict[str, Any] = {}
            logged = len(nginx.access_log.read_text().splitlines())
            t0 = time.perf_counter()
            th = threading.Thread(target=lambda: done.update(r=replay(nginx.url, "kill mid-run")))
            th.start()
            killed_at = None
            while th.is_alive():
                if (
                    killed_at is None
                    and len(nginx.access_log.read_text().splitlines()) - logged >= n_req // 3
                ):
                    victim.kill()
                    killed_at = time.perf_counter() - t0
                time.sleep(0.05)
            th.join()
            _, recs = done["r"]
            cut = [r for r in recs if r.error and r.engine]
            lost = [r for r in recs if r.error and not r.engine]
            retried = [r for r in recs if "," in r.replica]
            print(
                f"kill at {killed_at}s: {len(cut)} streams cut mid-way (started on an engine), "
                f"{len(retried)} requests retried by nginx on another replica, {len(lost)} lost before "
                "reaching an engine",
                flush=True,
            )
            report["kill"] = {"cut": len(cut), "retried": len(retried), "lost": len(lost)}
            ok = ok and not lost
    finally:
        if nginx is not None:
            nginx.stop()
        for r in replicas:
            r.stop()
        redis.stop()
        for e in engines:
            e.stop()
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
