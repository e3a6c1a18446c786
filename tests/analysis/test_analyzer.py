"""PromptAnalyzer: the same tokens and hashes as the tokenizer in every mode, 400s carried back from
worker processes, a full backlog or a spent budget skips to the approximate index (counted),
session tokens bounded by bytes, workers fed raw JSON bytes (the gateway's cache_salt wins) and
answering without token ids unless asked, mid-sized prompts on the thread lane."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.analysis import Analysis, AnalysisRequest, AnalysisSkipped, PromptAnalyzer
from gateway.analysis.tokenize import ChatTokenizer
from gateway.api.errors import to_api_error
from gateway.config import AnalysisConfig, ModelConfig
from gateway.errors import BadRequest
from gateway.service.metrics import GatewayMetrics

SYSTEM = "You are a careful agent. " * 200


def body(user: str, n: int = 1) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SYSTEM * n}, {"role": "user", "content": user}]}


async def analyze(
    an: PromptAnalyzer,
    model: str,
    kind: str,
    body: dict[str, Any],
    session_id: str | None = None,
    *,
    raw: bytes | None = None,
    tokens: bool = True,
) -> Analysis:
    info = await an.analyze(AnalysisRequest(model, kind, body, raw, tokens or session_id is not None))
    if session_id is not None:  # what the gateway does once the turn is admitted
        an.remember(session_id, info.tokens)
    return info


def models(tiny_llama: Path) -> list[ModelConfig]:
    return [
        ModelConfig(name="m", tokenizer=str(tiny_llama), block_size=128, hash_seed="0"),
        ModelConfig(name="plain"),
    ]


@pytest.mark.parametrize("mode", ["inline", "thread", "process", "process+thread"])
async def test_every_mode_gives_the_tokenizers_answer(tiny_llama: Path, mode: str) -> None:
    metrics = GatewayMetrics()
    # "process": every prompt here goes to a worker process; "process+thread": to the thread lane
    thread_chars = 100_000 if mode == "process+thread" else 0
    cfg = AnalysisConfig(mode=mode.split("+")[0], small_chars=1000, thread_chars=thread_chars)
    an = PromptAnalyzer(models(tiny_llama), cfg, metrics)
    try:
        await an.wait_ready()
        ref = ChatTokenizer(tiny_llama, 128, "0")
        for b in (body("small"), body("large " * 500)):
            info = await analyze(an, "m", "chat", b, session_id="s")
            assert info is not None
            want = ref.prompt_info("chat", b)
            assert (list(info.tokens), info.hashes) == (list(want.tokens), want.hashes)
            assert an.session_tokens("s") == list(want.tokens)
        # a turn extending the previous one is incremental inside the worker too
        nxt = body("large " * 500)
        nxt["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
        info = await analyze(an, "m", "chat", nxt)
        assert info is not None and info.encoded_tokens < 20
        with pytest.raises(AnalysisSkipped) as skip:  # no tokenizer for this model (not counted)
            await analyze(an, "plain", "chat", body("x"))
        assert skip.value.reason == "no_tokenizer"
        with pytest.raises(BadRequest) as err:
            await analyze(an, "m", "chat", {**body("x"), "tools": [{"type": "function", "function": {}}]})
        assert to_api_error(err.value).status == 400 and err.value.field == "tools[0].function.name"
        with pytest.raises(AnalysisSkipped) as skip:
            await analyze(an, "m", "chat", {**body("x"), "chat_template": "{{ 1 }}"})
        assert skip.value.reason.startswith("unsupported")
        assert an.skipped == {"unsupported": 1}
        assert b'agentgw_analysis_skipped_total{reason="unsupported"} 1.0' in metrics.render()
    finally:
        await an.aclose()


async def test_a_full_backlog_and_a_spent_budget_skip_to_the_approximate_index(tiny_llama: Path) -> None:
    # a budget no loaded machine spends (the first part is about the backlog, not the budget)
    cfg = AnalysisConfig(mode="process", max_backlog=1, budget_ms=600_000, small_chars=1000, thread_chars=0)
    an = PromptAnalyzer(models(tiny_llama), cfg)
    try:
        await an.wait_ready()
        big = [body(f"q{i}", n=150) for i in range(4)]  # ~150K tokens each: the large lane
        tasks = [asyncio.create_task(analyze(an, "m", "chat", b)) for b in big]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert any(d is not None and not isinstance(d, BaseException) for d in done)
        backlog = [d for d in done if isinstance(d, AnalysisSkipped)]
        assert backlog and all(d.reason.startswith("backlog") for d in backlog)
        # the small lane is not blocked by the large one, and tiny prompts never leave the loop
        assert await analyze(an, "m", "chat", {"messages": [{"role": "user", "content": "hello " * 800}]})
        assert await analyze(an, "m", "chat", {"messages": [{"role": "user", "content": "hi"}]})
        assert an.tokenizers["m"].cached_entries == 1
    finally:
        await an.aclose()
    an = PromptAnalyzer(models(tiny_llama), AnalysisConfig(mode="thread", budget_ms=1, small_chars=1000))
    try:
        with pytest.raises(AnalysisSkipped) as skip:
            await analyze(an, "m", "chat", body("x", n=100))
        assert skip.value.reason == "budget" and an.skipped == {"budget": 1}
        await asyncio.sleep(0)
        # the skipped work went on and warmed the cache: the same prompt again is a cache hit
        an2 = an.tokenizers["m"]
        for _ in range(2400):  # up to 120 s: the event, not the time, is what is checked
            if an2.cached_entries:
                break
            await asyncio.sleep(0.05)
        assert an2.cached_entries == 1
    finally:
        await an.aclose()


async def test_session_tokens_are_bounded_by_bytes(tiny_llama: Path) -> None:
    an = PromptAnalyzer(models(tiny_llama), AnalysisConfig(mode="inline", session_tokens_bytes=40_000))
    for i in range(10):
        await analyze(an, "m", "chat", body(f"user {i}", n=2), session_id=f"s{i}")
    kept = [i for i in range(10) if an.session_tokens(f"s{i}") is not None]
    assert kept and kept[-1] == 9 and kept[0] > 0
    an.forget("s9")
    assert an.session_tokens("s9") is None


async def test_workers_get_raw_bytes_and_send_token_ids_only_when_asked(tiny_llama: Path) -> None:
    cfg = AnalysisConfig(mode="process", small_chars=1000, thread_chars=0)
    an = PromptAnalyzer(models(tiny_llama), cfg)
    ref = ChatTokenizer(tiny_llama, 128, "0")
    try:
        await an.wait_ready()
        b = body("raw " * 400)
        raw = orjson.dumps({**b, "cache_salt": "client"})
        salted = {**b, "cache_salt": "tenant"}  # the gateway's copy: the tenant's salt replaced it
        info = await analyze(an, "m", "chat", salted, raw=raw, tokens=False)
        want = ref.prompt_info("chat", salted)
        assert info is not None and info.hashes == want.hashes and info.num_tokens == want.num_tokens
        assert info.hashes != ref.prompt_info("chat", {**b, "cache_salt": "client"}).hashes
        assert list(info.tokens) == []  # not asked for: not sent back
        info = await analyze(an, "m", "chat", b, raw=raw, tokens=True)  # the salt removed
        want = ref.prompt_info("chat", b)
        assert info is not None and (list(info.tokens), info.hashes) == (list(want.tokens), want.hashes)
        info = await analyze(an, "m", "chat", b, "s", raw=orjson.dumps(b), tokens=False)
        assert an.session_tokens("s") == list(want.tokens)  # a session keeps them: sent back
    finally:
        await an.aclose()


async def test_mid_sized_prompts_use_the_thread_lane(tiny_llama: Path) -> None:
    cfg = AnalysisConfig(mode="process", inline_chars=100, thread_chars=20_000, small_chars=30_000)
    an = PromptAnalyzer(models(tiny_llama), cfg)
    try:
        await an.wait_ready()
        assert await analyze(an, "m", "chat", body("mid " * 500))  # ~7K chars: thread lane
        assert an.tokenizers["m"].cached_entries == 1  # the in-process tokenizer did it
        assert await analyze(an, "m", "chat", body("big " * 6000))  # ~29K chars: a worker process
        assert an.tokenizers["m"].cached_entries == 1
    finally:
        await an.aclose()


async def test_large_bodies_reach_the_worker_through_shared_memory(tiny_llama: Path) -> None:
    """Bodies of 64 KiB to 1 MiB are written into the worker's shared-memory arena (the socket
    carries their place), one slot per request the backlog admits; a larger body goes through
    the socket (in several writes: more than its buffer); every answer equals the tokenizer's
    and every slot comes back."""
    from gateway.analysis import worker as analysis

    cfg = AnalysisConfig(mode="process", thread_chars=0, workers=1, small_workers=1, budget_ms=600_000)
    an = PromptAnalyzer(models(tiny_llama), cfg)
    ref = ChatTokenizer(tiny_llama, 128, "0")
    try:
        await an.wait_ready()
        bodies = [body(f"request {i} " + "word " * 14_000) for i in range(cfg.max_backlog - 1)]
        bodies.append(body("huge " + "word " * 230_000))  # > 1 MiB: the pipe
        raws = [orjson.dumps(b) for b in bodies]
        assert all(analysis.ARENA_MIN_BYTES <= len(r) <= analysis.ARENA_SLOT_BYTES for r in raws[:-1])
        assert len(raws[-1]) > analysis.ARENA_SLOT_BYTES
        infos = await asyncio.gather(
            *(analyze(an, "m", "chat", b, raw=r, tokens=True) for b, r in zip(bodies, raws, strict=True))
        )
        for b, info in zip(bodies, infos, strict=True):
            want = ref.prompt_info("chat", b)
            assert info is not None and (list(info.tokens), info.hashes) == (list(want.tokens), want.hashes)
        arenas = [w.arena for w in an.workers if w.arena.shm is not None]
        assert len(arenas) == 1  # the lane these bodies went to made its arena; nobody else did
        assert sorted(arenas[0].free) == list(range(cfg.max_backlog))  # one slot per backlog place: all back
        name = arenas[0].shm.name if arenas[0].shm else ""
    finally:
        await an.aclose()
    assert not Path("/dev/shm", name.lstrip("/")).exists()  # unlinked on close


def _reaped(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _until(cond: Any) -> None:
    for _ in range(2400):  # up to 120 s: the event, not the time, is what is checked
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition never held")


async def test_a_worker_killed_mid_request_fails_it_cleanly_and_is_restarted(tiny_llama: Path) -> None:
    """The request in flight to a worker that dies is skipped (``worker_died``, counted), its
    arena slot comes back, and the next request is answered by a new worker process, exactly."""
    import os
    import signal

    metrics = GatewayMetrics()
    cfg = AnalysisConfig(mode="process", thread_chars=0, small_chars=1000, budget_ms=600_000)
    an = PromptAnalyzer(models(tiny_llama), cfg, metrics)
    ref = ChatTokenizer(tiny_llama, 128, "0")
    try:
        await an.wait_ready()
        large = an.lanes["large"]
        (worker,) = large.workers()
        old_pid = worker.pid
        assert old_pid is not None
        b = body("doomed", n=150)  # ~750 KB of JSON: through the arena
        task = asyncio.create_task(analyze(an, "m", "chat", b, raw=orjson.dumps(b)))
        await _until(lambda: large.backlog[0] == 1)
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(AnalysisSkipped) as skip:
            await task
        assert skip.value.reason == "worker_died" and an.skipped == {"worker_died": 1}
        assert b'agentgw_analysis_skipped_total{reason="worker_died"} 1.0' in metrics.render()
        assert large.backlog == [0] and large.queued_chars == [0]
        assert worker.arena.shm is not None and len(worker.arena.free) == cfg.max_backlog  # slot back
        assert worker.restarts == 1
        await an.wait_ready()
        assert worker.pid not in (None, old_pid)
        nxt = body("next", n=150)
        info = await analyze(an, "m", "chat", nxt, raw=orjson.dumps(nxt))
        want = ref.prompt_info("chat", nxt)
        assert info is not None and (list(info.tokens), info.hashes) == (list(want.tokens), want.hashes)
        await _until(lambda: _reaped(old_pid))  # the dead worker is not left a zombie
        assert an.skipped == {"worker_died": 1}
    finally:
        await an.aclose()


async def test_shutdown_stops_every_worker_and_fails_what_is_in_flight(tiny_llama: Path) -> None:
    import multiprocessing

    cfg = AnalysisConfig(mode="process", thread_chars=0, small_chars=1000, budget_ms=600_000)
    an = PromptAnalyzer(models(tiny_llama), cfg)
    await an.wait_ready()
    workers = an.workers
    pids = [w.pid for w in workers]
    assert len(workers) == 2 and None not in pids
    big = body("in flight", n=150)
    task = asyncio.create_task(analyze(an, "m", "chat", big, raw=orjson.dumps(big)))
    await _until(lambda: an.lanes["large"].backlog[0] == 1)
    shm = workers[0].arena.shm
    assert shm is not None
    await an.aclose()
    with pytest.raises(AnalysisSkipped) as skip:
        await task
    assert skip.value.reason == "worker_died"
    assert all(pid is not None and _reaped(pid) for pid in pids)  # exited and reaped
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)
    assert not Path("/dev/shm", shm.name.lstrip("/")).exists()
    assert all(w.restarts == 0 for w in workers)  # a stopped worker is not started again
    with pytest.raises(AnalysisSkipped) as skip:  # after shutdown: approximate, not a crash
        await analyze(an, "m", "chat", big)
    assert skip.value.reason == "closed"


async def test_worker_answers_equal_the_inline_analysis(tiny_llama: Path) -> None:
    """Through the socket (small and large bodies, raw bytes or a converted dict, with and
    without token ids, a 400, an unsupported template) the answer is the inline analyser's."""
    inline = PromptAnalyzer(models(tiny_llama), AnalysisConfig(mode="inline"))
    cfg = AnalysisConfig(mode="process", inline_chars=0, thread_chars=0, small_chars=5000)
    an = PromptAnalyzer(models(tiny_llama), cfg)
    try:
        await an.wait_ready()
        tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
        cases = [
            body("hi"),
            body("hello " * 2000),
            {**body("with tools " * 100), "tools": tools},
            {**body("salted " * 100), "cache_salt": "t1"},
            body("long " * 50_000, n=20),
        ]
        for b in cases:
            want = await analyze(inline, "m", "chat", b)
            assert want is not None
            for raw, tokens in ((orjson.dumps(b), True), (orjson.dumps(b), False), (None, True)):
                got = await analyze(an, "m", "chat", b, raw=raw, tokens=tokens)
                assert got is not None
                assert (got.num_tokens, got.hashes) == (want.num_tokens, want.hashes)
                assert list(got.tokens) == (list(want.tokens) if tokens else [])
        bad = {**body("x"), "tools": [{"type": "function", "function": {}}]}
        with pytest.raises(BadRequest) as err:
            await analyze(an, "m", "chat", bad, raw=orjson.dumps(bad))
        assert (to_api_error(err.value).status, err.value.field) == (400, "tools[0].function.name")
        with pytest.raises(AnalysisSkipped):
            await analyze(an, "m", "chat", {**body("x"), "chat_template": "{{ 1 }}"})
        # bytes that do not parse fail that request only: the worker answers the next one
        with pytest.raises(AnalysisSkipped) as skip:
            await analyze(an, "m", "chat", body("x"), raw=b'{"messages": [')
        assert skip.value.reason.startswith("worker_error: JSONDecodeError")
        assert an.skipped["worker_error"] == 1
        assert await analyze(an, "m", "chat", body("after"), raw=orjson.dumps(body("after")))
        assert all(w.restarts == 0 for w in an.workers)
    finally:
        await an.aclose()


def test_an_arena_with_no_free_slot_sends_through_the_socket() -> None:
    from gateway.analysis.worker import ARENA_MIN_BYTES, Arena

    arena = Arena(2)
    raw = b"x" * ARENA_MIN_BYTES
    try:
        got = [arena.put(raw) for _ in range(3)]
        assert got[0] is not None and got[1] is not None and got[2] is None  # full: the socket
        assert arena.put(b"small") is None  # under 64 KiB: the socket
        arena.release(got[0][1])
        again = arena.put(raw)
        assert again is not None and again[1] == got[0][1]
    finally:
        arena.close()


_LEFT_UP = """
import sys
from gateway.analysis.worker import AnalysisWorker

w = AnalysisWorker([("m", sys.argv[1], 128, "0", True)], 1 << 20)
w._proc.join(2.0)  # started (no event loop here: not waited for ready)
print(w._proc.pid, flush=True)
"""


def test_a_process_that_exits_with_a_worker_left_running_does_not_wait_for_it(tiny_llama: Path) -> None:
    """A worker ignores SIGTERM (it serves the gateway's drain), and the only worker end of the
    socket stays open while the module keeps `w`: multiprocessing's exit handler (SIGTERM, then
    join) would wait for ever; the worker module's own handler kills it first."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _LEFT_UP, str(tiny_llama)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.split()[0])
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
