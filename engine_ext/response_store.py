"""A bounded Responses-API store for vLLM's API server.

vLLM 0.32 keeps what ``POST /v1/responses`` stores (``store: true`` with
``VLLM_ENABLE_RESPONSES_API_STORE=1``) in three plain dicts of ``OpenAIServingResponses``, never
evicted: ``response_store`` (id -> the response), ``msg_store`` (id -> the whole conversation
rendered for it: every stored turn of a chain holds the chain's full history, so a chain of n
turns costs O(n^2) bytes) and ``event_store`` (id -> a background stream's events). This module
replaces the three with :class:`BoundedStore` objects once the class is built:

- least recently used first, at most ``max_entries`` entries and ``max_bytes`` bytes in each of
  the three (an entry's size is its JSON length; a value larger than ``max_bytes`` is not kept).
  A background stream's entry grows after it is stored: vLLM appends each event to the deque it
  put in ``event_store``, so the serving object's ``responses_stream_generator`` is wrapped, for
  background requests only, to count each event's JSON length into its entry as it is made
  (:meth:`BoundedStore.grow`); a stream that outgrows the bound is evicted like any other entry
  (vLLM's own task keeps appending to its deque until the stream ends, then lets it go);
- the three forget an id together: a response is never continued without its history, and no
  history outlives its response. A ``previous_response_id`` or ``GET /v1/responses/{id}`` for an
  evicted id then gets vLLM's own 404 (``invalid_request_error``, "Response with id '...' not
  found.", ``param: response_id``);
- entries, bytes and evictions are exported on the engine's ``/metrics``
  (``agentgw_engine_responses_store_{entries,bytes,evictions_total}{store=...}``).

Enabled by engine_ext's vLLM plugin (:mod:`engine_ext.plugin`) when the environment sets
``AGENTGW_RESPONSES_STORE_MAX_ENTRIES`` and/or ``AGENTGW_RESPONSES_STORE_MAX_BYTES`` (the
gateway's local engines get both, see ``gateway/local/engines.py``); the serving module is
patched when it is imported, so the engine-core and worker processes, which never import it,
pay nothing. ``tests/engine_ext/test_response_store_surface.py`` pins the vLLM attributes used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import weakref
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping
from types import ModuleType
from typing import Any, TypeVar

__all__ = [
    "ENV_MAX_BYTES",
    "ENV_MAX_ENTRIES",
    "SERVING_MODULE",
    "BoundedStore",
    "bound",
    "counted_events",
    "events_size",
    "install",
    "install_from_env",
    "json_size",
]

ENV_MAX_ENTRIES = "AGENTGW_RESPONSES_STORE_MAX_ENTRIES"
ENV_MAX_BYTES = "AGENTGW_RESPONSES_STORE_MAX_BYTES"
SERVING_MODULE = "vllm.entrypoints.openai.responses.serving"
STORES = ("response_store", "msg_store", "event_store")

V = TypeVar("V")


def _plain(o: Any) -> Any:
    dump = getattr(o, "model_dump", None)  # pydantic models (responses, output items, messages)
    if callable(dump):
        return dump(mode="json")
    return repr(o)


def json_size(value: Any) -> int:
    """An entry's size in bytes: the length of its JSON form (pydantic models dumped; anything
    JSON cannot take, by its ``repr``: measuring never fails the request that stores it)."""
    try:
        dump_json = getattr(value, "model_dump_json", None)
        if callable(dump_json):
            return len(dump_json())
        return len(json.dumps(value, default=_plain, ensure_ascii=False).encode())
    except (TypeError, ValueError):
        return len(repr(value).encode())


def events_size(value: Any) -> int:
    """An ``event_store`` entry's size: its events' JSON length (vLLM's entry is ``(deque of
    events, asyncio.Event)``; anything else by :func:`json_size`)."""
    if isinstance(value, tuple) and value and isinstance(value[0], deque):
        return sum(json_size(e) for e in value[0])
    return json_size(value)


class BoundedStore(MutableMapping[str, V]):
    """A dict with a bound on entries and bytes, least recently used out first. Reading an
    entry (``store[id]``, ``store.get(id)``) makes it the most recent; ``id in store`` does not.
    Stores in :attr:`linked` forget an evicted id too."""

    def __init__(
        self,
        name: str,
        max_entries: int | None,
        max_bytes: int | None,
        sizer: Callable[[Any], int] = json_size,
    ) -> None:
        self.name = name
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.sizer = sizer
        self.bytes = 0
        self.evictions = 0
        self.linked: list[BoundedStore[Any]] = []
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()

    def __getitem__(self, key: str) -> V:
        value, _ = self._items[key]
        self._items.move_to_end(key)
        return value

    def __setitem__(self, key: str, value: V) -> None:
        size = self.sizer(value)
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (value, size)
        self.bytes += size
        while self._items and self._over():
            self._evict(next(iter(self._items)))

    def grow(self, key: str, nbytes: int) -> None:
        """Count ``nbytes`` more for ``key``'s entry, whose value grew in place (a background
        stream's new event), evicting as ``__setitem__`` does; a key not held is ignored (its
        entry was evicted while its stream ran). Growing does not make an entry more recent."""
        held = self._items.get(key)
        if held is None:
            return
        self._items[key] = (held[0], held[1] + nbytes)
        self.bytes += nbytes
        while self._items and self._over():
            self._evict(next(iter(self._items)))

    def __delitem__(self, key: str) -> None:
        _, size = self._items.pop(key)
        self.bytes -= size

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def _over(self) -> bool:
        return (self.max_entries is not None and len(self._items) > self.max_entries) or (
            self.max_bytes is not None and self.bytes > self.max_bytes
        )

    def _evict(self, key: str) -> None:
        del self[key]
        self.evictions += 1
        for other in self.linked:
            other.discard(key)

    def discard(self, key: str) -> None:
        """Forget ``key`` if held (no eviction counted, nothing linked told)."""
        if key in self._items:
            del self[key]


def bound(serving: Any, max_entries: int | None, max_bytes: int | None) -> list[BoundedStore[Any]]:
    """Replace the stores of one ``OpenAIServingResponses`` with bounded, linked ones (keeping
    anything already in them, oldest first)."""
    stores: list[BoundedStore[Any]] = [
        BoundedStore("response_store", max_entries, max_bytes),
        BoundedStore("msg_store", max_entries, max_bytes),
        BoundedStore("event_store", max_entries, max_bytes, events_size),
    ]
    for s in stores:
        s.linked = [o for o in stores if o is not s]
    for s in stores:
        for key, value in getattr(serving, s.name).items():
            s[key] = value
        setattr(serving, s.name, s)
    _measure_background_events(serving, stores[2])
    _collector().watch(stores)
    return stores


def _measure_background_events(serving: Any, events: BoundedStore[Any]) -> None:
    """Wrap the serving object's event generator so that a background request's events are
    counted into its ``event_store`` entry as vLLM appends them (foreground streams untouched)."""
    make = getattr(serving, "responses_stream_generator", None)
    if make is None:
        return

    def responses_stream_generator(request: Any, *args: Any, **kwargs: Any) -> Any:
        stream = make(request, *args, **kwargs)
        if not getattr(request, "background", False):
            return stream
        return counted_events(stream, events, request.request_id)

    serving.responses_stream_generator = responses_stream_generator


async def counted_events(stream: Any, events: BoundedStore[Any], key: str) -> AsyncIterator[Any]:
    """``stream``'s events, each counted into ``events[key]`` (while held) before it is passed on."""
    try:
        async for event in stream:
            if key in events:
                events.grow(key, json_size(event))
            yield event
    finally:
        await stream.aclose()


class _Collector:
    """Exports every live bounded store's size on the process's default Prometheus registry
    (the one vLLM's API server serves on ``/metrics``)."""

    def __init__(self) -> None:
        self._stores: weakref.WeakValueDictionary[int, BoundedStore[Any]] = weakref.WeakValueDictionary()

    def watch(self, stores: list[BoundedStore[Any]]) -> None:
        for s in stores:
            self._stores[id(s)] = s

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        prefix = "agentgw_engine_responses_store"
        entries = GaugeMetricFamily(
            f"{prefix}_entries", "Entries in vLLM's Responses store", labels=["store"]
        )
        size = GaugeMetricFamily(
            f"{prefix}_bytes", "JSON bytes held by vLLM's Responses store", labels=["store"]
        )
        evicted = CounterMetricFamily(
            f"{prefix}_evictions", "Entries evicted from vLLM's Responses store", labels=["store"]
        )
        for s in list(self._stores.values()):
            entries.add_metric([s.name], len(s))
            size.add_metric([s.name], s.bytes)
            evicted.add_metric([s.name], s.evictions)
        yield from (entries, size, evicted)


_COLLECTOR: list[_Collector] = []  # one per process, registered once


def _collector() -> _Collector:
    if not _COLLECTOR:
        from prometheus_client import REGISTRY

        c = _Collector()
        REGISTRY.register(c)
        _COLLECTOR.append(c)
    return _COLLECTOR[0]


def _patch(module: ModuleType, max_entries: int | None, max_bytes: int | None) -> None:
    cls = module.OpenAIServingResponses
    if getattr(cls, "_agentgw_bounded", False):
        return
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        bound(self, max_entries, max_bytes)

    cls.__init__ = __init__
    cls._agentgw_bounded = True
    cls._agentgw_original_init = original


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after ``name`` is first imported (then steps aside)."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        then = self.then

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            then(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install(max_entries: int | None, max_bytes: int | None) -> None:
    """Bound the Responses store of every ``OpenAIServingResponses`` this process builds."""

    def then(module: ModuleType) -> None:
        _patch(module, max_entries, max_bytes)

    loaded = sys.modules.get(SERVING_MODULE)
    if loaded is not None:
        then(loaded)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(SERVING_MODULE, then))


def _limit(env: dict[str, str] | os._Environ[str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    value = int(raw)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


def install_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """:func:`install` with the limits the environment sets; False when it sets none (or vLLM's
    store is off, so nothing is stored)."""
    if env.get("VLLM_ENABLE_RESPONSES_API_STORE", "0") in ("", "0"):
        return False
    max_entries, max_bytes = _limit(env, ENV_MAX_ENTRIES), _limit(env, ENV_MAX_BYTES)
    if max_entries is None and max_bytes is None:
        return False
    install(max_entries, max_bytes)
    return True
