"""What the whole stack costs at start: ``agentgw serve``'s local engines with plain vLLM
(``--store none``), with engine_ext (``host``, the default: offload connector, host tier, pinning
scheduler, control API) and with the Mooncake tier (``mooncake``), started one after the other in
one run: seconds until every engine answers, and the resident memory of the engines' process
groups (API server, EngineCore; the shared host-tier region counts only as it fills).

    flock /tmp/agentgw-heavy.lock python -m benchmarks.stack_start --repeats 2     # ~6 min
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from gateway.local.embedded import STORES, start_local_stack


def group_rss_mib(pgid: int) -> float:
    """Resident memory of every process in group ``pgid`` (MiB)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            status = (stat.parent / "status").read_text()
        except (OSError, ValueError):
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.stack_start", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--stores", default="none,host,mooncake")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    stores = [s for s in args.stores.split(",") if s]
    rows: dict[str, list[tuple[float, float]]] = {s: [] for s in stores}
    with tempfile.TemporaryDirectory(prefix="agentgw-stack-start-") as tmp:
        for r in range(args.repeats):
            for store in stores:
                assert store in STORES, store
                t = time.monotonic()
                stack = start_local_stack(store=store, home=Path(tmp) / f"{store}-{r}", timeout_s=600)  # type: ignore[arg-type]
                ready = time.monotonic() - t
                time.sleep(5)  # past start-up's transient allocations
                rss = sum(group_rss_mib(e.pid) for e in stack.engines if e.pid is not None)
                stack.stop()
                rows[store].append((ready, rss))
                print(f"{store} repeat {r}: ready {ready:.1f} s, engines' RSS {rss:.0f} MiB", flush=True)
    print(f"\n3 engines (tiny-llama, 1 GiB KV each), {args.repeats} repeats, {os.cpu_count()} CPUs\n")
    print("| store | ready s (median) | engines' RSS MiB (median) |")
    print("|---|---|---|")
    for store, vals in rows.items():
        ready = statistics.median(v[0] for v in vals)
        rss = statistics.median(v[1] for v in vals)
        print(f"| {store} | {ready:.1f} | {rss:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
