"""Parity and bandwidth of the KV-block movers (``kernels.kv_copy`` vs ``kernels.reference``).

On a CUDA machine (written for one H200, vllm==0.32.0 / torch CUDA): for Llama-3-70B-like caches
(80 layers, 8 KV heads, head_dim 128, bf16; FlashAttention layout ``[2, N, bs, H, D]`` with block
size 16 and 64, and the CPU-platform layout ``[N, H, bs, 2D]`` with block size 16), and for a
large and a small transfer (``--ids``), it times

- ``gather`` / ``scatter``: GPU cache <-> GPU staging rows;
- ``gather_d2h`` / ``scatter_h2d``: GPU cache <-> pinned host staging rows;
- ``copy_d2h`` / ``copy_h2d``: GPU cache <-> pinned host cache of the same geometry;

each with Triton and with the torch reference, next to the ``cudaMemcpy`` peak (a contiguous
``Tensor.copy_`` of the same number of bytes, D2D / D2H / H2D) measured in the same run. Every
Triton result is checked against the reference first; any mismatch makes the exit status 1.
Before timing, the rest of the CUDA paths are checked once: ``kernels``' dispatcher on CUDA and
pinned tensors, and FP8 packing on the GPU against the CPU's, byte for byte.

Bandwidth counts payload bytes once (bytes of the blocks moved), for the kernels and for memcpy.
A time budget (``--budget-s``, default 100 s) skips what is left, so the run ends within 2 min.

On a machine without CUDA (``--device cpu`` or no GPU): the torch reference only, checked against
a per-block ``select`` loop, on a CPU-platform geometry (block size 128), plus the CPU memcpy
peak. ``--quick`` shrinks everything (used by the test suite). With ``TRITON_INTERPRET=1`` the CPU
run also checks the Triton kernels' parity (``interpret_parity``: the same gather / scatter /
copy calls the CUDA run makes, on CPU tensors under Triton's interpreter; no timing): a smoke
test of the kernels this script times on the H200, runnable in CI.

Usage: ``python benchmarks/kv_copy_gpu.py [--device auto|cuda|cpu] [--quick] [--iters N] [--threads N]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import reference


@dataclass(frozen=True)
class Geometry:
    name: str
    layout: str  # "flash" [2, N, bs, H, D] or "cpu" [N, H, bs, 2D]
    num_layers: int
    num_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    id_counts: tuple[int, ...]

    @property
    def block_dim(self) -> int:
        return 1 if self.layout == "flash" else 0

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.layout == "flash":
            return (2, num_blocks, self.block_size, self.num_heads, self.head_dim)
        return (num_blocks, self.num_heads, self.block_size, 2 * self.head_dim)


CUDA_GEOMETRIES = [
    Geometry("70b-flash-bs16", "flash", 80, 8, 128, 16, 2048, (256, 16)),
    Geometry("70b-flash-bs64", "flash", 80, 8, 128, 64, 512, (64, 4)),
    Geometry("70b-cpulayout-bs16", "cpu", 80, 8, 128, 16, 2048, (256, 16)),
]
CPU_GEOMETRIES = [
    Geometry("8L-cpulayout-bs128", "cpu", 8, 8, 128, 128, 48, (16, 2)),
    Geometry("8L-flash-bs16", "flash", 8, 8, 128, 16, 384, (128,)),
]
QUICK_CPU_GEOMETRIES = [
    Geometry("2L-cpulayout-bs128", "cpu", 2, 8, 128, 128, 12, (4,)),
    Geometry("2L-flash-bs16", "flash", 2, 8, 128, 16, 48, (16,)),
]


@dataclass
class Row:
    geometry: str
    op: str
    impl: str
    nbytes: int
    seconds: float
    peak_gbs: float | None

    @property
    def gbs(self) -> float:
        return self.nbytes / self.seconds / 1e9


class Bench:
    def __init__(self, device: torch.device, iters: int, budget_s: float) -> None:
        self.device = device
        self.iters = iters
        self.deadline = time.monotonic() + budget_s
        self.rows: list[Row] = []
        self.failures: list[str] = []
        self.skipped = 0

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time(self, fn: Callable[..., object], *args: object, **kwargs: object) -> float:
        """Seconds per call after one warm-up call, over up to ``iters`` calls or about 0.5 s:
        the mean on CUDA (calls queue back to back), the median on CPU (a shared machine is noisy)."""
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        self._sync()
        iters = max(1, min(self.iters, int(0.5 / max(time.perf_counter() - t0, 1e-6))))
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            for _ in range(iters):
                fn(*args, **kwargs)
            self._sync()
            return (time.perf_counter() - t0) / iters
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn(*args, **kwargs)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def record(
        self,
        where: tuple[str, str, str, int, float | None],
        fn: Callable[..., object],
        *args: object,
        **kwargs: object,
    ) -> None:
        """Time ``fn(*args, **kwargs)`` as the row ``(geometry, op, impl, nbytes, peak GB/s)``."""
        if self.out_of_time():
            self.skipped += 1
            return
        geometry, op, impl, nbytes, peak = where
        self.rows.append(Row(geometry, op, impl, nbytes, self.time(fn, *args, **kwargs), peak))

    def check(self, what: str, ok: bool) -> None:
        if not ok:
            self.failures.append(what)
            print(f"PARITY FAILURE: {what}", flush=True)


def memcpy_peak(bench: Bench, nbytes: int, src_device: torch.device, dst_device: torch.device) -> float:
    pin = bench.device.type == "cuda"
    src = torch.empty(
        nbytes, dtype=torch.uint8, device=src_device, pin_memory=pin and src_device.type == "cpu"
    )
    dst = torch.empty(
        nbytes, dtype=torch.uint8, device=dst_device, pin_memory=pin and dst_device.type == "cpu"
    )
    return nbytes / bench.time(dst.copy_, src, non_blocking=True) / 1e9


def make_caches(
    geo: Geometry, num_blocks: int, device: torch.device, pin: bool = False
) -> list[torch.Tensor]:
    shape = geo.layer_shape(num_blocks)
    if pin:
        return [torch.zeros(shape, dtype=torch.bfloat16, pin_memory=True) for _ in range(geo.num_layers)]
    return [torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(geo.num_layers)]


def naive_gather(caches: list[torch.Tensor], ids: torch.Tensor, block_dim: int) -> torch.Tensor:
    """An independent per-block implementation, for parity on CPU."""
    rows = [
        torch.cat([c.select(block_dim, int(b)).contiguous().reshape(-1).view(torch.uint8) for c in caches])
        for b in ids
    ]
    return torch.stack(rows)


def _gather_ref(
    caches: list[torch.Tensor], ids: torch.Tensor, block_dim: int, device: torch.device
) -> torch.Tensor:
    out = torch.empty(
        ids.numel(), reference.block_nbytes(caches, block_dim), dtype=torch.uint8, device=device
    )
    return reference.gather_blocks(caches, ids, out, block_dim=block_dim)


def _rows(n: int, row: int, device: torch.device) -> torch.Tensor:
    """A staging buffer; pinned when it is host memory next to a GPU."""
    pin = device.type == "cpu" and torch.cuda.is_available()
    return torch.empty(n, row, dtype=torch.uint8, device=device, pin_memory=pin)


def run_cuda(bench: Bench, quick: bool) -> None:
    from kernels import kv_copy

    cuda, cpu = bench.device, torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    for geo in CUDA_GEOMETRIES[:1] if quick else CUDA_GEOMETRIES:
        bd = geo.block_dim
        caches = make_caches(geo, geo.num_blocks, cuda)
        row = reference.block_nbytes(caches, bd)
        for n in geo.id_counts:
            if bench.out_of_time():
                bench.skipped += 1
                continue
            label, nbytes = f"{geo.name} x{n}", n * row
            ids = torch.randperm(geo.num_blocks, generator=gen)[:n].to(cuda)
            peaks = {
                "d2d": memcpy_peak(bench, nbytes, cuda, cuda),
                "d2h": memcpy_peak(bench, nbytes, cuda, cpu),
                "h2d": memcpy_peak(bench, nbytes, cpu, cuda),
            }
            for name, gbs in peaks.items():
                bench.rows.append(Row(label, f"memcpy_{name}", "cudaMemcpy", nbytes, nbytes / gbs / 1e9, gbs))

            # GPU cache <-> staging rows on the GPU, then in pinned host memory.
            for rows_dev, gather_op, scatter_op, out_peak, in_peak in (
                (cuda, "gather", "scatter", "d2d", "d2d"),
                (cpu, "gather_d2h", "scatter_h2d", "d2h", "h2d"),
            ):
                expected = reference.gather_blocks(caches, ids, _rows(n, row, rows_dev), block_dim=bd)
                got = kv_copy.gather_blocks(caches, ids, _rows(n, row, rows_dev), block_dim=bd)
                torch.cuda.synchronize()
                bench.check(f"{label} {gather_op}", torch.equal(got, expected))
                for impl, mod in (("triton", kv_copy), ("torch", reference)):
                    bench.record(
                        (label, gather_op, impl, nbytes, peaks[out_peak]),
                        mod.gather_blocks,
                        caches,
                        ids,
                        got,
                        block_dim=bd,
                    )
                fresh = _rows(n, row, rows_dev)
                fresh.copy_(torch.randint(0, 256, (n, row), dtype=torch.uint8, generator=gen))
                kv_copy.scatter_blocks(fresh, caches, ids, block_dim=bd)
                bench.check(
                    f"{label} {scatter_op}", torch.equal(_gather_ref(caches, ids, bd, rows_dev), fresh)
                )
                for impl, mod in (("triton", kv_copy), ("torch", reference)):
                    bench.record(
                        (label, scatter_op, impl, nbytes, peaks[in_peak]),
                        mod.scatter_blocks,
                        fresh,
                        caches,
                        ids,
                        block_dim=bd,
                    )
                del expected, got, fresh

            # GPU cache <-> a pinned host cache of the same geometry.
            host_blocks = n + max(4, n // 4)
            host = make_caches(geo, host_blocks, cpu, pin=True)
            host_ids = torch.randperm(host_blocks, generator=gen)[:n].to(cuda)
            want = _gather_ref(caches, ids, bd, cpu)
            kv_copy.copy_blocks(caches, host, ids, host_ids, block_dim=bd)
            torch.cuda.synchronize()
            bench.check(f"{label} copy_d2h", torch.equal(_gather_ref(host, host_ids.cpu(), bd, cpu), want))
            for blank in caches:  # forget the blocks, then bring them back from the host
                blank.index_fill_(bd, ids, 0)
            kv_copy.copy_blocks(host, caches, host_ids, ids, block_dim=bd)
            bench.check(f"{label} copy_h2d", torch.equal(_gather_ref(caches, ids, bd, cpu), want))
            for impl, mod in (("triton", kv_copy), ("torch", reference)):
                bench.record(
                    (label, "copy_d2h", impl, nbytes, peaks["d2h"]),
                    mod.copy_blocks,
                    caches,
                    host,
                    ids,
                    host_ids,
                    block_dim=bd,
                )
            for impl, mod in (("triton", kv_copy), ("torch", reference)):
                bench.record(
                    (label, "copy_h2d", impl, nbytes, peaks["h2d"]),
                    mod.copy_blocks,
                    host,
                    caches,
                    host_ids,
                    ids,
                    block_dim=bd,
                )
            del host, want
        del caches
        torch.cuda.empty_cache()


def cuda_dispatch_and_fp8_parity(bench: Bench) -> None:
    """The rest of the CUDA paths, checked once: ``kernels``' dispatcher on CUDA and pinned tensors
    (``auto`` must pick the Triton kernels and match the reference, the engine worker's path), and
    FP8 packing on the GPU against the same packing on the CPU (byte for byte, both directions)."""
    import kernels
    from kernels import kv_copy

    cuda, cpu = bench.device, torch.device("cpu")
    gen = torch.Generator().manual_seed(2)
    for geo in QUICK_CPU_GEOMETRIES:
        bd, n = geo.block_dim, geo.id_counts[0]
        caches = make_caches(geo, geo.num_blocks, cuda)
        host = make_caches(geo, n + 4, cpu, pin=True)
        ids = torch.randperm(geo.num_blocks, generator=gen)[:n].to(cuda)
        host_ids = torch.randperm(n + 4, generator=gen)[:n].to(cuda)
        bench.check(f"{geo.name} dispatch picks triton", kernels._backend([*caches, *host]) is kv_copy)
        want = _gather_ref(caches, ids, bd, cpu)
        kernels.copy_blocks(caches, host, ids, host_ids, block_dim=bd)
        torch.cuda.synchronize()
        bench.check(
            f"{geo.name} dispatch copy_d2h", torch.equal(_gather_ref(host, host_ids.cpu(), bd, cpu), want)
        )
        staged = kernels.gather_blocks(
            caches, ids, _rows(n, reference.block_nbytes(caches, bd), cpu), block_dim=bd
        )
        torch.cuda.synchronize()
        bench.check(f"{geo.name} dispatch gather_d2h", torch.equal(staged, want))
    for dtype in (torch.bfloat16, torch.float16):
        for group in (128, 32):
            values = (torch.randn(1 << 20, generator=gen) * 3).to(dtype)
            values[:group] = 0  # an all-zero group
            nbytes = kernels.fp8_nbytes(values.numel(), group)
            on_cpu = kernels.quantize_fp8(values, torch.empty(nbytes, dtype=torch.uint8), group=group)
            on_gpu = kernels.quantize_fp8(
                values.to(cuda), torch.empty(nbytes, dtype=torch.uint8, device=cuda), group=group
            )
            bench.check(f"fp8 quantize {dtype} g{group} cuda == cpu", torch.equal(on_gpu.cpu(), on_cpu))
            back_cpu = kernels.dequantize_fp8(on_cpu, torch.empty_like(values), group=group)
            back_gpu = kernels.dequantize_fp8(
                on_cpu.to(cuda), torch.empty_like(values, device=cuda), group=group
            )
            bench.check(f"fp8 dequantize {dtype} g{group} cuda == cpu", torch.equal(back_gpu.cpu(), back_cpu))
    print("dispatcher (cuda + pinned) and fp8 (cuda vs cpu): checked", flush=True)


def run_cpu(bench: Bench, quick: bool) -> None:
    cpu = bench.device
    gen = torch.Generator().manual_seed(0)
    for geo in QUICK_CPU_GEOMETRIES if quick else CPU_GEOMETRIES:
        bd = geo.block_dim
        caches = make_caches(geo, geo.num_blocks, cpu)
        dst = make_caches(geo, geo.num_blocks, cpu)
        row = reference.block_nbytes(caches, bd)
        for n in geo.id_counts:
            label, nbytes = f"{geo.name} x{n}", n * row
            ids = torch.randperm(geo.num_blocks, generator=gen)[:n]
            dst_ids = torch.randperm(geo.num_blocks, generator=gen)[:n]
            peak = memcpy_peak(bench, nbytes, cpu, cpu)
            bench.rows.append(Row(label, "memcpy", "memcpy", nbytes, nbytes / peak / 1e9, peak))
            staged = _gather_ref(caches, ids, bd, cpu)
            bench.check(f"{label} gather", torch.equal(staged, naive_gather(caches, ids, bd)))
            reference.scatter_blocks(staged, dst, dst_ids, block_dim=bd)
            bench.check(f"{label} scatter", torch.equal(naive_gather(dst, dst_ids, bd), staged))
            for blank in dst:
                blank.index_fill_(bd, dst_ids, 0)
            reference.copy_blocks(caches, dst, ids, dst_ids, block_dim=bd)
            bench.check(f"{label} copy", torch.equal(naive_gather(dst, dst_ids, bd), staged))
            bench.record(
                (label, "gather", "torch", nbytes, peak),
                reference.gather_blocks,
                caches,
                ids,
                staged,
                block_dim=bd,
            )
            bench.record(
                (label, "scatter", "torch", nbytes, peak),
                reference.scatter_blocks,
                staged,
                dst,
                dst_ids,
                block_dim=bd,
            )
            bench.record(
                (label, "copy", "torch", nbytes, peak),
                reference.copy_blocks,
                caches,
                dst,
                ids,
                dst_ids,
                block_dim=bd,
            )


def interpret_parity(bench: Bench) -> None:
    """The CUDA run's Triton calls on CPU tensors under ``TRITON_INTERPRET=1``, checked against the
    reference (every quick geometry: the CPU layout and FlashAttention's K/V split)."""
    from kernels import kv_copy

    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(1)
    for geo in QUICK_CPU_GEOMETRIES:
        bd = geo.block_dim
        caches = make_caches(geo, geo.num_blocks, cpu)
        row = reference.block_nbytes(caches, bd)
        n = geo.id_counts[0]
        label = f"{geo.name} x{n} triton-interp"
        ids = torch.randperm(geo.num_blocks, generator=gen)[:n]
        expected = reference.gather_blocks(caches, ids, _rows(n, row, cpu), block_dim=bd)
        got = kv_copy.gather_blocks(caches, ids, _rows(n, row, cpu), block_dim=bd)
        bench.check(f"{label} gather", torch.equal(got, expected))
        fresh = torch.randint(0, 256, (n, row), dtype=torch.uint8, generator=gen)
        kv_copy.scatter_blocks(fresh, caches, ids, block_dim=bd)
        bench.check(f"{label} scatter", torch.equal(_gather_ref(caches, ids, bd, cpu), fresh))
        host_blocks = n + 4
        host = make_caches(geo, host_blocks, cpu)
        host_ids = torch.randperm(host_blocks, generator=gen)[:n]
        kv_copy.copy_blocks(caches, host, ids, host_ids, block_dim=bd)
        bench.check(f"{label} copy", torch.equal(_gather_ref(host, host_ids, bd, cpu), fresh))
        print(f"{label}: gather, scatter, copy checked against the reference", flush=True)


def print_table(rows: list[Row]) -> None:
    header = f"{'geometry x ids':<26} {'op':<12} {'impl':<10} {'MB':>9} {'ms':>9} {'GB/s':>8} {'% memcpy':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        pct = f"{100 * r.gbs / r.peak_gbs:8.0f}%" if r.peak_gbs else ""
        print(
            f"{r.geometry:<26} {r.op:<12} {r.impl:<10} {r.nbytes / 1e6:9.1f} {r.seconds * 1e3:9.3f} {r.gbs:8.1f} {pct:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--quick", action="store_true", help="small geometries, few iterations")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--budget-s", type=float, default=100.0, help="skip what is left after this")
    args = parser.parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        print("--device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    iters = args.iters or (3 if args.quick else 10)
    bench = Bench(device, iters, args.budget_s)
    started = time.monotonic()
    if use_cuda:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
        cuda_dispatch_and_fp8_parity(bench)
        run_cuda(bench, args.quick)
    else:
        print(
            f"device: cpu ({torch.get_num_threads()} threads), torch reference only  torch {torch.__version__}"
        )
        run_cpu(bench, args.quick)
        if os.environ.get("TRITON_INTERPRET") == "1":
            interpret_parity(bench)
    print_table(bench.rows)
    if bench.skipped:
        print(f"skipped {bench.skipped} measurements: time budget of {args.budget_s:.0f} s spent")
    print(f"total {time.monotonic() - started:.1f} s; parity failures: {len(bench.failures)}")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
