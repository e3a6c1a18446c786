"""Live replay end to end without engines: a tiny trace through a gateway in front of the stand-in
engine (testing/fake_engine.py), checking the dependency order, the hints and the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.live_replay import (
    LiveConfig,
    PromptSynth,
    format_table,
    load_trace,
    main,
    replay,
    run_live,
    summarize_live,
)
from gateway.sim.scale import to_weka
from gateway.sim.traces import Play
from testing.fake_engine import EngineState, serve
from tests.conftest import ServedGateway, wait_ready

MODEL = "tiny-llama"


def _tiny_trace(tmp: Path) -> Path:
    """One play: 3 root turns (growing context), one subagent of 2 turns spawned after turn 0."""
    blocks = list(range(1, 9))
    reqs: list[dict[str, object]] = [
        {"t": 0.0, "type": "n", "in": 4 * 64 + 10, "out": 4, "hash_ids": blocks[:4], "api_time": 0.05},
        {
            "t": 0.06,
            "type": "subagent",
            "agent_id": "explorer",
            "requests": [
                {"t": 0.06, "type": "n", "in": 2 * 64 + 5, "out": 3, "hash_ids": [1, 100], "api_time": 0.02},
                {"t": 0.1, "type": "n", "in": 3 * 64, "out": 3, "hash_ids": [1, 100, 101], "api_time": 0.02},
            ],
        },
        {"t": 0.2, "type": "n", "in": 6 * 64 + 3, "out": 5, "hash_ids": blocks[:6], "api_time": 0.05},
        {"t": 0.3, "type": "n", "in": 8 * 64 + 1, "out": 5, "hash_ids": blocks[:8], "api_time": 0.05},
    ]
    path = tmp / "play.json"
    path.write_text(json.dumps({"id": "p0", "block_size": 64, "requests": reqs}))
    return path


class _FakeEngine:
    """The stand-in engine in a thread (its own event loop)."""

    def __init__(self) -> None:
        self.state = EngineState(MODEL, tokens=8, ttft_s=0.002, itl_s=0.001)
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop

        def started(server: asyncio.Server) -> None:
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()

        self._task = loop.create_task(serve("127.0.0.1", 0, self.state, started))
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(self._task)
        loop.close()

    def __enter__(self) -> _FakeEngine:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def fake_gateway() -> Iterator[tuple[str, str]]:
    with _FakeEngine() as eng:
        config = {
            "pools": [
                {
                    "name": "default",
                    "role": "any",
                    "engines": [{"name": "f0", "url": eng.url, "model": MODEL}],
                }
            ],
            "timeouts": {"health_interval_s": 0.2, "metrics_interval_s": 0.2},
        }
        with ServedGateway(config) as gw:
            wait_ready(gw.url)
            yield gw.url, eng.url


def _plays(tmp_path: Path, scale: bool = False) -> list[Play]:
    return load_trace(_tiny_trace(tmp_path), scale=scale, max_context=1024, block_size=128, max_output=8)


def test_prompts_share_blocks_exactly_where_hash_ids_do(tmp_path: Path) -> None:
    play = _plays(tmp_path)[0]
    synth = PromptSynth(vocab_size=4096, salt=7)
    ids = [synth.token_ids(play, r) for r in play.requests]
    assert [len(x) for x in ids] == [r.input_tokens for r in play.requests]
    root0, sub0, sub1, root1 = ids[0], ids[1], ids[2], ids[3]
    assert root1[: 4 * 64] == root0[: 4 * 64]  # same 4 hash ids
    assert root1[4 * 64 : 4 * 64 + 10] != root0[4 * 64 :]  # the partial block is never shared
    assert sub0[:64] == root0[:64] and sub0[64:128] != root0[64:128]  # hash id 1 shared, then not
    assert sub1[:128] == sub0[:128]
    assert all(3 <= t < 4096 for x in ids for t in x)
    other = PromptSynth(vocab_size=4096, salt=8).token_ids(play, play.requests[0])
    assert other[:64] != root0[:64]  # a new salt does not hit an old run's cache
    assert "\n" in synth.text(play, play.requests[3])


def test_replay_runs_end_to_end_with_hints_and_metrics(tmp_path: Path, fake_gateway: tuple[str, str]) -> None:
    url, engine_url = fake_gateway
    plays = _plays(tmp_path)
    cfg = LiveConfig(url=url, model=MODEL, speedup=1.0, lanes=1, salt=1, progress=False)
    m, records = run_live(plays, cfg, [engine_url], label="hints")
    assert m.requests == 5 and m.errors == 0, [r.error for r in records]
    by_idx = {r.idx: r for r in records}
    reqs = plays[0].requests
    # dependencies: each turn after its predecessor's completion + the recorded gap
    for r in reqs:
        for d in r.deps:
            assert by_idx[r.idx].t_arrive >= by_idx[d.on].t_arrive
            if d.trigger == "completion":
                assert by_idx[r.idx].t_arrive + 1e-3 >= by_idx[d.on].t_last + d.delay_s
    assert all(r.engine == "f0" for r in records)
    assert [r.output_tokens for r in sorted(records, key=lambda r: r.idx)] == [4, 3, 3, 5, 5]
    assert m.ttft_p50_ms > 0 and m.interactivity_p90 > 0
    assert m.makespan_s >= max(r.t_last for r in records) - min(r.t_arrive for r in records) - 1e-6
    assert 0 < m.ideal_hit_rate < 1 and m.hit_rate == 0.0  # the stand-in reports no cached tokens
    assert m.engines_used == {"f0": 5}
    # the hints reached the gateway: sessions, parent and child, turns
    root = httpx.get(f"{url}/v1/agent/sessions/p0").json()
    sub = httpx.get(f"{url}/v1/agent/sessions/p0%23explorer").json()
    assert root["turns"] == 3 and sub["turns"] == 2
    assert sub["parent_session_id"] == "p0" and "p0#explorer" in root["children"]
    assert "hits" not in format_table([m]).split("\n")[0]


def test_no_hints_and_header_hints(tmp_path: Path, fake_gateway: tuple[str, str]) -> None:
    url, _ = fake_gateway
    plays = _plays(tmp_path, scale=True)
    for p in plays:
        p.play_id = "nohint"
    records = asyncio.run(replay(plays, LiveConfig(url=url, hints="none", speedup=20.0, progress=False)))
    assert len(records) == 5 and not any(r.error for r in records)
    assert httpx.get(f"{url}/v1/agent/sessions/nohint").status_code == 404
    for p in plays:
        p.play_id = "hdr"
    records = asyncio.run(replay(plays, LiveConfig(url=url, hints="headers", speedup=20.0, progress=False)))
    assert not any(r.error for r in records)
    assert httpx.get(f"{url}/v1/agent/sessions/hdr").json()["turns"] == 3
    assert httpx.get(f"{url}/v1/agent/sessions/hdr%23explorer").json()["parent_session_id"] == "hdr"
    m = summarize_live(records, plays)
    assert m.requests == 5 and m.engine_hit_rate != m.engine_hit_rate  # nan without engine counters


def test_cli_prints_a_table_and_writes_json_and_weka(
    tmp_path: Path, fake_gateway: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    url, engine_url = fake_gateway
    trace = _tiny_trace(tmp_path)
    out = tmp_path / "out.json"
    weka = tmp_path / "weka"
    rc = main(
        ["--url", url, "--trace", str(trace), "--scale", "--max-context", "1024", "--speedup", "20"]
        + ["--engines", engine_url, "--json", str(out), "--write-weka", str(weka), "--no-progress"]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT p50" in text and "hints" in text
    data = json.loads(out.read_text())
    assert len(data["runs"]["hints"]["records"]) == 5
    written = json.loads((weka / "p0.json").read_text())
    assert written["block_size"] == 128
    again = load_trace(weka / "p0.json")[0]
    assert [r.input_tokens for r in again.requests] == [
        r.input_tokens for r in _plays(tmp_path, scale=True)[0].requests
    ]
    assert to_weka(again)["block_size"] == 128
