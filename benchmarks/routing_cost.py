"""Routing decision cost vs context length (1K-200K tokens) and number of engines (4-256).

For one agent session whose context grows turn by turn, measures per turn:
- ``prompt``: exact prompt tokens + vLLM block hashes (chat template render, incremental
  tokenization from the last special-token boundary, incremental hash chain);
- ``prompt_scratch``: the same from scratch (what a naive gateway pays every turn), the baseline;
- ``match``: the prefix-index lookup over all engines;
- ``route``: the pure router (agentic profile) on a snapshot of N engines.
Prints medians (microseconds) and the scratch/incremental ratio. The machine is noisy: compare
rows within one run.

    python -m benchmarks.routing_cost [--engines 4 16 64 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from gateway.analysis.tokenize import ChatTokenizer
from gateway.core.prefix_index import PrefixIndex
from gateway.core.router import Router, RoutingParams
from gateway.core.types import EngineView, PoolRole, RouteRequest, SessionView, Snapshot
from gateway.local.tiny_model import build_tiny_model

CHECKPOINTS = (1_000, 8_000, 32_000, 64_000, 128_000, 200_000)
WORDS = [
    "def",
    "update(self,",
    "tokens):",
    "return",
    "sorted(items,",
    "key=len)",
    "#",
    "refactor",
    "the",
    "parser",
    "module",
    "and",
    "rerun",
    "tests",
]


def grow(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "agentgw-bench-model")
    args = ap.parse_args(argv)

    model = build_tiny_model(args.model_dir, "llama")
    tok = ChatTokenizer(model, 128, "0")
    scratch_tok = ChatTokenizer(model, 128, "0")
    rng = random.Random(0)
    messages = [{"role": "system", "content": "You are a coding agent. " + grow(rng, 300)}]
    rows = []
    cps = list(CHECKPOINTS)
    turn = 0
    while cps:
        messages += [
            {"role": "user", "content": grow(rng, 60)},
            {"role": "assistant", "content": grow(rng, 120)},
            {"role": "tool", "content": grow(rng, 500)},
        ]
        turn += 1
        body = {"messages": messages}
        info = tok.prompt_info("chat", body, "s")
        if info.num_tokens < cps[0]:
            continue
        target = cps.pop(0)
        t_inc, t_scr = [], []
        for r in range(args.repeat):
            probe = {"messages": messages + [{"role": "user", "content": f"probe {r} " + grow(rng, 40)}]}
            tok.prompt_info("chat", body, f"p{r}")  # the session's previous turn is cached
            t0 = time.perf_counter()
            pinfo = tok.prompt_info("chat", probe, f"p{r}")
            t_inc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            scratch_tok.prompt_info("chat", probe, None)
            t_scr.append(time.perf_counter() - t0)
        hashes = pinfo.hashes
        for n in args.engines:
            index = PrefixIndex()
            engines = tuple(
                EngineView(
                    f"e{i}", "warm", PoolRole.WARM, frozenset({"m"}), running=i % 7, kv_usage=(i % 10) / 10
                )
                for i in range(n)
            )
            index.apply_stored("e1", hashes[:-2])
            for i in range(2, n):  # others hold the shared system prompt and their own sessions
                index.apply_stored(
                    f"e{i}", hashes[:2] + [rng.getrandbits(64) for _ in range(len(hashes) // 4)]
                )
            router = Router(RoutingParams())
            req = RouteRequest("m", pinfo.num_tokens, 128, session_id="s", seq=1)
            session = SessionView("s", "e1", "warm", turn, pinfo.num_tokens)
            t_match, t_route = [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                matches = index.match(hashes)
                t_match.append(time.perf_counter() - t0)
                snap = Snapshot(engines=engines, matches=matches, session=session)
                t0 = time.perf_counter()
                d = router.route(req, snap)
                t_route.append(time.perf_counter() - t0)
            assert d.engine == "e1"
            rows.append(
                (
                    target,
                    pinfo.num_tokens,
                    pinfo.encoded_tokens,
                    n,
                    us(t_inc),
                    us(t_scr),
                    us(t_match),
                    us(t_route),
                )
            )

    print(
        f"{'context':>8} {'tokens':>8} {'encoded':>8} {'engines':>7} {'prompt us':>10} {'scratch us':>11} "
        f"{'ratio':>6} {'match us':>9} {'route us':>9} {'total us':>9}"
    )
    for target, ntok, enc, n, inc, scr, m, r in rows:
        print(
            f"{target:>8} {ntok:>8} {enc:>8} {n:>7} {inc:>10.0f} {scr:>11.0f} {scr / inc:>6.1f} {m:>9.1f} {r:>9.1f} "
            f"{inc + m + r:>9.0f}"
        )


if __name__ == "__main__":
    main()
