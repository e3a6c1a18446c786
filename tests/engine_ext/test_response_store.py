"""engine_ext's bounded Responses store, without an engine: the LRU bound on entries and bytes, the
three stores forgetting an id together, the environment switch, and (in a fresh interpreter, as
vLLM's API server loads the plugin) the patch applied when vLLM's serving module is imported, on
the attributes vLLM 0.32 really has. The real engine: tests/gateway/test_responses_store_e2e.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine_ext.response_store import (
    ENV_MAX_BYTES,
    ENV_MAX_ENTRIES,
    BoundedStore,
    bound,
    events_size,
    install_from_env,
    json_size,
)

ROOT = Path(__file__).resolve().parents[2]


def test_entries_bound_evicts_the_least_recently_used() -> None:
    s: BoundedStore[str] = BoundedStore("response_store", max_entries=3, max_bytes=None)
    for k in "abc":
        s[k] = k
    assert s.get("a") == "a"  # a read makes "a" the most recent
    s["d"] = "d"
    assert list(s) == ["c", "a", "d"] and s.evictions == 1 and "b" not in s
    assert s.get("b") is None


def test_bytes_bound_counts_json_length_and_refuses_an_oversized_value() -> None:
    s: BoundedStore[object] = BoundedStore("msg_store", max_entries=None, max_bytes=100)
    s["a"] = "x" * 40  # 42 bytes of JSON
    s["b"] = "y" * 40
    assert s.bytes == 84 and len(s) == 2
    s["c"] = "z" * 40
    assert list(s) == ["b", "c"] and s.bytes == 84
    s["b"] = "short"  # replacing an entry counts its new size only
    assert s.bytes == 42 + 7
    s["huge"] = "h" * 500  # larger than the whole bound: not kept, nothing else lost for it
    assert "huge" not in s and s.bytes <= 100
    assert json_size({"role": "user", "content": "hé"}) == len('{"role": "user", "content": "hé"}'.encode())


def test_the_three_stores_forget_an_id_together() -> None:
    serving = SimpleNamespace(response_store={}, msg_store={}, event_store={})
    responses, messages, _events = bound(serving, max_entries=2, max_bytes=10_000)
    assert serving.response_store is responses and serving.msg_store is messages
    for rid in ("r1", "r2"):
        serving.msg_store[rid] = [{"role": "user", "content": rid}]
        serving.response_store[rid] = {"id": rid}
    serving.event_store["r1"] = ("deque", "event")
    serving.msg_store["r3"] = [{"role": "user", "content": "r3"}]  # evicts r1's history ...
    assert "r1" not in serving.msg_store
    assert "r1" not in serving.response_store and "r1" not in serving.event_store  # ... and r1
    serving.response_store["r3"] = {"id": "r3"}
    assert sorted(serving.response_store) == ["r2", "r3"] == sorted(serving.msg_store)
    assert messages.evictions == 1 and responses.evictions == 0


class _Serving:
    """The shape of vLLM 0.32's ``OpenAIServingResponses`` that the store touches: the three dicts,
    the event generator, and ``_run_background_request_stream``'s use of them (the events of a
    background request go into the deque it stored, one by one)."""

    def __init__(self) -> None:
        self.response_store: dict[str, object] = {}
        self.msg_store: dict[str, object] = {}
        self.event_store: dict[str, object] = {}

    async def responses_stream_generator(
        self, request: SimpleNamespace, n: int
    ) -> AsyncIterator[dict[str, str]]:
        for i in range(n):
            yield {"type": "response.output_text.delta", "delta": f"{request.request_id}-{i:03d}"}

    async def background_stream(self, request: SimpleNamespace, n: int) -> deque[dict[str, str]]:
        events: deque[dict[str, str]] = deque()
        self.response_store[request.request_id] = {"id": request.request_id}
        self.event_store[request.request_id] = (events, asyncio.Event())
        async for event in self.responses_stream_generator(request, n):
            events.append(event)
        return events


def test_background_stream_events_count_toward_the_bytes_bound_and_evict_their_id_everywhere() -> None:
    serving = _Serving()
    event_bytes = len(b'{"type": "response.output_text.delta", "delta": "r1-000"}')
    responses, _messages, events = bound(serving, max_entries=10, max_bytes=25 * event_bytes)

    async def run() -> None:
        def bg(rid: str) -> SimpleNamespace:
            return SimpleNamespace(request_id=rid, background=True)

        got = await serving.background_stream(bg("r1"), 10)
        assert len(got) == 10 and events.bytes == 10 * event_bytes  # counted as they came
        assert events_size(serving.event_store["r1"]) == events.bytes
        await serving.background_stream(bg("r2"), 10)
        assert events.bytes == 20 * event_bytes and "r1" in serving.event_store
        # r3's events push the total past the bound: the oldest id goes, from every store
        await serving.background_stream(bg("r3"), 10)
        assert "r1" not in serving.event_store and "r1" not in serving.response_store
        assert sorted(serving.event_store) == ["r2", "r3"] == sorted(serving.response_store)
        assert events.bytes == 20 * event_bytes <= 25 * event_bytes and events.evictions == 1
        # a stream that alone outgrows the bound is not kept (its own task still gets every event)
        whole = await serving.background_stream(bg("big"), 30)
        assert len(whole) == 30 and "big" not in serving.event_store and "big" not in serving.response_store
        assert events.bytes <= 25 * event_bytes
        # a foreground stream is not counted anywhere
        fg = [e async for e in serving.responses_stream_generator(SimpleNamespace(request_id="f"), 5)]
        assert len(fg) == 5 and "f" not in serving.event_store

    before = events.bytes
    asyncio.run(run())
    assert before == 0 and responses.evictions == 0  # evicted through the event store, not its own


def test_environment_switch() -> None:
    assert install_from_env({ENV_MAX_ENTRIES: "5"}) is False  # vLLM's store is off: nothing stored
    assert install_from_env({"VLLM_ENABLE_RESPONSES_API_STORE": "1"}) is False  # no bound asked
    with pytest.raises(ValueError, match=ENV_MAX_BYTES):
        install_from_env({"VLLM_ENABLE_RESPONSES_API_STORE": "1", ENV_MAX_BYTES: "0"})


def test_the_plugin_bounds_vllms_serving_class_when_it_is_imported() -> None:
    code = textwrap.dedent(
        """
        import inspect, sys
        from engine_ext.plugin import register
        register()  # as vLLM's plugin loader calls it, before the serving module is imported
        assert "vllm.entrypoints.openai.responses.serving" not in sys.modules
        from vllm.entrypoints.openai.responses import serving
        cls = serving.OpenAIServingResponses
        assert cls._agentgw_bounded is True
        # the vLLM 0.32 attributes the patch replaces are the ones its __init__ creates
        src = inspect.getsource(cls._agentgw_original_init)
        for name in ("self.response_store", "self.msg_store", "self.event_store"):
            assert name in src, name
        # and the methods that read them use them as a mapping
        body = inspect.getsource(cls)
        assert "self.response_store.get(" in body and "self.msg_store.get(" in body
        # a background stream's events go into the deque it stored, from the generator the
        # store wraps to count them
        bg = inspect.getsource(cls._run_background_request_stream)
        assert "self.event_store[request.request_id] = (event_deque" in bg, bg
        assert "self.responses_stream_generator(request" in bg and "event_deque.append(event)" in bg, bg
        print("patched")
        """
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        ENV_MAX_ENTRIES: "3",
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("patched"), done.stderr[-3000:]
