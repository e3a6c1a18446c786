"""Predictions from what the gateway observes, not from constants: an engine's pass times, a
session's next turn, a link's transfer time. Pure (no clock, no I/O): observations and times are
passed in; each update is O(1) and each table is bounded.

- :class:`EngineModel` fits an engine's :class:`~gateway.core.policies.cost.EngineCost` online,
  starting from a prior (the ``cost_*`` constants): a prefill pass of ``T`` uncached tokens takes
  ``p0 + p1*T + p2*T^2`` ms, a decode step at KV use ``u`` with ``b`` decoding sequences reading
  ``C`` context tokens takes ``d0 + d1*u + d2*u^2 + s*b + k*C/1e6`` ms. Both are linear in their
  parameters, fitted by recursive least squares with forgetting ``forget`` (an engine's speed
  drifts: a new version, another neighbour on the node), each observation weighted by its
  relative error (a short pass counts as much as a long one). The prior enters as the initial
  estimate with a covariance ``prior_weight`` observations strong, so a few observations move it
  little and many replace it. Inputs are what the gateway sees: a turn's prefill time (TTFT when
  the engine had no backlog, less the decode passes it rode in) and the inter-token gaps of a
  stream against the engine's batch and KV use from its ``/metrics``.
- :class:`SessionModel` learns each session's output tokens per turn, tool gap and context growth
  from its own turns, shrunk toward the fleet's running means by ``prior_turns`` pseudo-turns: a
  new session is the fleet's typical one, a session with many turns is itself. Hinted values
  take precedence. At most ``max_sessions`` sessions (least recently seen out).
- :class:`LinkModel` keeps each path's bandwidth (a running mean of completed transfers, from a
  prior) and its backlog (bytes started and not finished: the gateway's own ledger on stock
  engines, the control API's report on engine_ext engines), and prices a new transfer as its wait
  behind the backlog plus its own time, so that a move that cannot finish before the session's
  expected return is not started.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

from gateway.core.policies.cost import EngineCost

__all__ = ["EngineModel", "LinkModel", "Rls", "SessionModel", "SessionShape"]


class Rls:
    """Recursive least squares with exponential forgetting over ``n`` parameters (pure Python:
    the models here have 3 and 5, so an update is a few dozen multiplications)."""

    __slots__ = ("forget", "n", "p", "samples", "theta")

    def __init__(self, theta: list[float], variance: list[float], forget: float = 0.999) -> None:
        self.n = len(theta)
        self.theta = list(theta)
        self.p = [[variance[i] if i == j else 0.0 for j in range(self.n)] for i in range(self.n)]
        self.forget = forget
        self.samples = 0

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x, strict=True))

    def update(self, x: list[float], y: float, weight: float = 1.0) -> None:
        """One observation ``y`` at features ``x``, counted ``weight`` times (its squared error
        weighs that much)."""
        if weight != 1.0:
            r = weight**0.5
            x, y = [v * r for v in x], y * r
        n, p, lam = self.n, self.p, self.forget
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        if denom <= 0:
            return
        gain = [v / denom for v in px]
        err = y - self.predict(x)
        self.theta = [t + g * err for t, g in zip(self.theta, gain, strict=True)]
        xp = [sum(x[i] * p[i][j] for i in range(n)) for j in range(n)]
        self.p = [[(p[i][j] - gain[i] * xp[j]) / lam for j in range(n)] for i in range(n)]
        self.samples += 1

    def update_relative(self, x: list[float], y: float) -> None:
        """An observation whose error is relative (a time off by a few percent, whatever its
        size): weighted by ``1 / y**2``, so short passes count as much as long ones."""
        if y > 0:
            self.update(x, y, 1.0 / (y * y))


_T = 1000.0
"""Prefill tokens are fitted in thousands (features near 1 keep the recursion well conditioned)."""


def _prefill_x(tokens: int) -> list[float]:
    t = tokens / _T
    return [1.0, t, t * t]


def _step_x(u: float, batch: int, context_tokens: int) -> list[float]:
    return [1.0, u, u * u, float(batch), context_tokens / 1e6]


def _vague(theta: list[float]) -> list[float]:
    """A start that knows almost nothing: each parameter's variance far above its scale."""
    scale = max(abs(t) for t in theta) or 1.0
    return [(100.0 * scale) ** 2 for _ in theta]


@dataclass(slots=True)
class EngineModel:
    """One engine's pass times, fitted online from a prior :class:`EngineCost`."""

    prior: EngineCost
    prior_weight: int = 5
    """How many observations the prior is worth: it enters as that many pseudo-observations of
    itself, spread over typical prefills and decode steps, on top of a vague start; so a few
    real observations move it a little and many replace it. (Errors are relative: a prior that
    is too fast claims more precision than one too slow, so keep it a few observations.)"""
    forget: float = 0.995
    """Each observation's weight decays by this per later one: the fit follows the last few
    hundred, so a drifting engine is followed."""
    prefill: Rls = field(init=False)
    step: Rls = field(init=False)

    def __post_init__(self) -> None:
        p0, p1, p2 = self.prior.prefill_ms
        theta = [p0, p1 * _T, p2 * _T * _T]
        self.prefill = Rls(theta, _vague(theta), self.forget)
        d0, d1, d2 = self.prior.decode_ms
        theta = [d0, d1, d2, self.prior.decode_seq_ms, self.prior.decode_kv_ms_per_mtok]
        self.step = Rls(theta, _vague(theta), self.forget)
        cap = self.prior.kv_capacity_tokens
        for i in range(self.prior_weight):
            tokens = 64 << (i % 9)  # 64 .. 16,384
            self.prefill.update_relative(_prefill_x(tokens), self.prior.pass_ms(tokens))
            u = 0.05 + 0.9 * ((i * 7) % self.prior_weight) / max(1, self.prior_weight - 1)
            batch = 1 << (i % 7)  # 1 .. 64
            ctx = int(u * cap * 0.75)
            d = self.prior
            ms = d.decode_ms[0] + d.decode_ms[1] * u + d.decode_ms[2] * u * u
            ms += d.decode_seq_ms * batch + d.decode_kv_ms_per_mtok * ctx / 1e6
            self.step.update_relative(_step_x(u, batch, ctx), ms)
        self.prefill.samples = self.step.samples = 0

    def observe_prefill(self, tokens: int, ms: float) -> None:
        """One prefill pass of ``tokens`` uncached tokens took ``ms``."""
        if tokens > 0 and ms > 0:
            self.prefill.update_relative(_prefill_x(tokens), ms)

    def observe_step(self, kv_usage: float, batch: int, context_tokens: int, ms: float) -> None:
        """One decode step (an inter-token gap) at KV use ``kv_usage`` with ``batch`` decoding
        sequences reading ``context_tokens`` took ``ms``."""
        if ms > 0 and batch > 0:
            self.step.update_relative(_step_x(kv_usage, batch, context_tokens), ms)

    def pass_ms(self, tokens: int) -> float:
        return max(0.0, self.prefill.predict(_prefill_x(tokens))) if tokens > 0 else 0.0

    def step_ms(self, kv_usage: float, batch: int, context_tokens: int) -> float:
        return max(1.0, self.step.predict(_step_x(kv_usage, batch, context_tokens)))

    def cost(self) -> EngineCost:
        """The prior with the fitted pass and step parameters: what the router prices with."""
        a, b, c = self.prefill.theta
        d0, d1, d2, s, k = self.step.theta
        return replace(
            self.prior,
            prefill_ms=(a, b / _T, c / (_T * _T)),
            decode_ms=(d0, d1, d2),
            decode_seq_ms=s,
            decode_kv_ms_per_mtok=k,
        )

    @property
    def samples(self) -> int:
        return self.prefill.samples + self.step.samples


@dataclass(slots=True)
class _Running:
    n: int = 0
    mean: float = 0.0

    def add(self, v: float) -> None:
        self.n += 1
        self.mean += (v - self.mean) / self.n


@dataclass(slots=True)
class SessionShape:
    """What one session has shown: turns seen, its means, the last turn's input."""

    output: _Running = field(default_factory=_Running)
    gap: _Running = field(default_factory=_Running)
    growth: _Running = field(default_factory=_Running)
    last_input: int | None = None
    last_end: float | None = None


@dataclass(slots=True)
class SessionModel:
    """Each session's next turn, from its own turns shrunk toward the fleet's."""

    prior_output_tokens: float = 444.0
    prior_gap_s: float = 10.0
    prior_growth_tokens: float = 2000.0
    prior_turns: float = 3.0
    """Pseudo-turns of the fleet's means in each session's estimate."""
    max_sessions: int = 65536
    fleet: SessionShape = field(default_factory=SessionShape)
    sessions: OrderedDict[str, SessionShape] = field(default_factory=OrderedDict)

    def observe_turn(
        self, session_id: str, start: float, end: float, input_tokens: int, output_tokens: int
    ) -> None:
        """A turn of ``session_id`` arrived at ``start`` with ``input_tokens`` and ended at
        ``end`` after ``output_tokens``: its gap is ``start`` less the previous turn's end, its
        growth ``input_tokens`` less the previous turn's input."""
        s = self.sessions.pop(session_id, None) or SessionShape()
        self.sessions[session_id] = s
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        for shape in (s, self.fleet):
            shape.output.add(output_tokens)
        if s.last_end is not None and start >= s.last_end:
            s.gap.add(start - s.last_end)
            self.fleet.gap.add(start - s.last_end)
        if s.last_input is not None and input_tokens >= s.last_input:
            s.growth.add(input_tokens - s.last_input)
            self.fleet.growth.add(input_tokens - s.last_input)
        s.last_input, s.last_end = input_tokens, end

    def _blend(self, own: _Running | None, fleet: _Running, prior: float) -> float:
        base = fleet.mean if fleet.n else prior
        if own is None or own.n == 0:
            return base
        k = self.prior_turns
        return (k * base + own.n * own.mean) / (k + own.n)

    def _shape(self, session_id: str) -> SessionShape | None:
        return self.sessions.get(session_id)

    def output_tokens(self, session_id: str, hinted: int | None = None) -> float:
        if hinted is not None:
            return float(hinted)
        s = self._shape(session_id)
        return self._blend(s.output if s else None, self.fleet.output, self.prior_output_tokens)

    def gap_s(self, session_id: str, hinted: float | None = None) -> float:
        if hinted is not None:
            return hinted
        s = self._shape(session_id)
        return self._blend(s.gap if s else None, self.fleet.gap, self.prior_gap_s)

    def growth_tokens(self, session_id: str) -> float:
        s = self._shape(session_id)
        return self._blend(s.growth if s else None, self.fleet.growth, self.prior_growth_tokens)

    def forget(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)


@dataclass(slots=True)
class _Link:
    bytes_per_s: float
    transfers: int = 0
    backlog: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class LinkModel:
    """Each path's bandwidth and backlog (a path: ``"host->engine-a"``, ``"store->engine-b"``,
    ``"engine-a->engine-b"``: the caller names them)."""

    prior_bytes_per_s: float = 2.3e9
    prior_transfers: float = 3.0
    """Pseudo-transfers of the prior in each path's bandwidth."""
    max_links: int = 4096
    max_inflight: int = 4096
    """Transfers tracked per path (the oldest is dropped from the backlog past it)."""
    links: OrderedDict[str, _Link] = field(default_factory=OrderedDict)

    def _link(self, path: str) -> _Link:
        link = self.links.pop(path, None) or _Link(self.prior_bytes_per_s)
        self.links[path] = link
        while len(self.links) > self.max_links:
            self.links.popitem(last=False)
        return link

    def started(self, path: str, transfer_id: str, nbytes: int) -> None:
        link = self._link(path)
        link.backlog[transfer_id] = nbytes
        while len(link.backlog) > self.max_inflight:
            link.backlog.pop(next(iter(link.backlog)))

    def finished(self, path: str, transfer_id: str, seconds: float | None) -> None:
        """The transfer ended (``seconds``: how long it took; None: failed or cancelled, which
        teaches nothing of the bandwidth)."""
        link = self._link(path)
        nbytes = link.backlog.pop(transfer_id, None)
        if nbytes is None or seconds is None or seconds <= 0 or nbytes <= 0:
            return
        link.transfers += 1
        weight = 1.0 / (self.prior_transfers + link.transfers)
        link.bytes_per_s += weight * (nbytes / seconds - link.bytes_per_s)

    def bytes_per_s(self, path: str) -> float:
        link = self.links.get(path)
        return link.bytes_per_s if link is not None else self.prior_bytes_per_s

    def backlog_bytes(self, path: str) -> int:
        link = self.links.get(path)
        return sum(link.backlog.values()) if link is not None else 0

    def transfer_s(self, path: str, nbytes: int) -> float:
        """When a transfer of ``nbytes`` started now on ``path`` would finish: its wait behind
        the backlog plus its own time."""
        bw = self.bytes_per_s(path)
        return (self.backlog_bytes(path) + max(0, nbytes)) / bw if bw > 0 else float("inf")

    def finishes_within(self, path: str, nbytes: int, seconds: float) -> bool:
        """Would the transfer end within ``seconds`` (the session's expected return, less a
        margin)? A move that would not is not worth starting."""
        return self.transfer_s(path, nbytes) <= seconds
