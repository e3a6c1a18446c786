"""Write seeded AgentX-shaped plays as Weka JSON, for the live replay (and aiperf, and the
simulator's ``--trace weka``).

    python -m gateway.sim.synth --n 96 --seed 1 --out /tmp/agentx-s1
    python -m gateway.sim.synth --n 8 --seed 1 --out /tmp/agentx-s1-small --scale --max-context 4096
    python -m benchmarks.live_replay --url http://127.0.0.1:8000 --trace /tmp/agentx-s1-small ...

The plays are :func:`gateway.sim.traces.synth_agentx`'s (deterministic in ``--seed``; the
``benchmarks.compare --trace synth --seed S`` plays). One file per play, ``<play id>.json``.
Unscaled files have ``hash_id_scope: global``: the plays' shared system prompt is the same
hash ids in every file, and :func:`~gateway.sim.traces.load_weka` chains such files from one
namespace, so a folder reloads into the same plays (same tokens, gaps, dependencies and prefix
sharing). ``--scale`` shrinks each play into a small context (:func:`gateway.sim.scale.
scale_plays`, one factor per play) and writes ``local`` scope: a system prompt of a few
thousand tokens scales below one block, so nothing is shared across plays there.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.sim.scale import scale_plays, weka_json
from gateway.sim.traces import GLOBAL_SCOPE, Play, synth_agentx

__all__ = ["write_plays"]


def write_plays(plays: Sequence[Play], out: Path, scope: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for p in plays:
        path = out / f"{p.play_id}.json"
        path.write_text(json.dumps(weka_json(p, scope)))
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gateway.sim.synth",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--n", type=int, default=48, help="plays")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="folder for the Weka JSON files")
    ap.add_argument("--scale", action="store_true", help="shrink into --max-context (live CPU engines)")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=64)
    args = ap.parse_args(argv)
    plays = synth_agentx(args.n, seed=args.seed)
    scope = GLOBAL_SCOPE
    if args.scale:
        plays = scale_plays(plays, args.max_context, args.block_size, args.max_output)
        scope = "local"
    written = write_plays(plays, Path(args.out), scope)
    n_req = sum(len(p.requests) for p in plays)
    print(f"wrote {len(written)} plays ({n_req} requests, seed {args.seed}, scope {scope}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
