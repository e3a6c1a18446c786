"""The local engine layout: how many engines `agentgw serve` starts and which pool each one joins.

:data:`DEFAULT` is what ``agentgw plan`` (gateway/sim/plan.py) recommends for 3 local engines,
recorded with the sweep that found it in ``benchmarks/plans/default_3engines.json``
(:data:`RECORD`). ``tests/benchmarks/test_default_layout.py`` checks that the record's
recommendation is :data:`DEFAULT` and that the record still describes the simulator as it is
(it re-runs the record's small fingerprint sweep and compares every figure), so the default
cannot drift from the measurement silently: a routing or simulator change fails that test until
the plan is re-run (``python -m gateway.sim.plan --record``, the command is in the record) and
:data:`DEFAULT` set to what it recommends.

Engines are named ``engine0 .. engine{N-1}``; the first ``first_turn`` of them form the
``first_turn`` pool and the rest the ``warm`` pool, or, with no first-turn engine, all of them one
pool of role ``any``. ``agentgw serve``, deploy/launch.py and docker-compose.yml (services
``engine0 ..``) use these names and pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["DEFAULT", "RECORD", "LayoutError", "LocalLayout", "resolve"]

Split = Literal["cost", "wall"]

RECORD = Path(__file__).resolve().parents[2] / "benchmarks" / "plans" / "default_3engines.json"
"""The plan run :data:`DEFAULT` comes from (in a source checkout; not installed with the package)."""


class LayoutError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class LocalLayout:
    engines: int
    first_turn: int = 0
    split: Split | None = None
    """The split of a layout with first-turn engines; ``None``: the config's ``routing.split``."""
    role_controller: bool | None = None
    """``routing.role_controller`` of a layout with first-turn engines; ``None``: the config's."""

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise LayoutError(f"a layout needs at least one engine, got {self.engines}")
        if not 0 <= self.first_turn < self.engines:
            raise LayoutError(
                f"first-turn engines must be 0 .. engines - 1 (a warm engine is needed), "
                f"got {self.first_turn} of {self.engines}"
            )

    @property
    def warm(self) -> int:
        return self.engines - self.first_turn

    @property
    def names(self) -> list[str]:
        return [f"engine{i}" for i in range(self.engines)]

    @property
    def label(self) -> str:
        """As ``agentgw plan`` prints it: ``one pool``, ``1+2 cost``, ``1+2 cost+ctl``, ``1+2 wall``."""
        if not self.first_turn:
            return "one pool"
        split = f" {self.split}" if self.split else ""
        return f"{self.first_turn}+{self.warm}{split}" + ("+ctl" if self.role_controller else "")

    def role(self, name: str) -> str:
        """The pool role of engine ``name``."""
        i = self.names.index(name)
        if not self.first_turn:
            return "any"
        return "first_turn" if i < self.first_turn else "warm"

    def pools(self, engines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The ``pools`` config for ``engines`` (one config entry per engine, in name order)."""
        if len(engines) != self.engines:
            raise LayoutError(f"the layout has {self.engines} engines, got {len(engines)}")
        if not self.first_turn:
            return [{"name": "default", "role": "any", "engines": engines}]
        f = self.first_turn
        return [
            {"name": "first_turn", "role": "first_turn", "engines": engines[:f]},
            {"name": "warm", "role": "warm", "engines": engines[f:]},
        ]

    def routing(self) -> dict[str, Any]:
        """The routing keys the layout sets (the rest are the config's)."""
        out: dict[str, Any] = {}
        if self.first_turn and self.split is not None:
            out["split"] = self.split
        if self.first_turn and self.role_controller is not None:
            out["role_controller"] = self.role_controller
        return out

    def serve_command(self) -> str:
        """The ``agentgw serve`` command line that starts this layout locally."""
        env = [f"AGENTGW_ROUTING__{k.upper()}={str(v).lower()}" for k, v in self.routing().items()]
        return " ".join(
            [*env, "agentgw serve", "--engines", str(self.engines), "--first-turn", str(self.first_turn)]
        )


DEFAULT = LocalLayout(engines=3, first_turn=0)
"""``agentgw serve``'s layout: the recommendation of the plan in :data:`RECORD` (one pool of 3)."""


def resolve(
    engines: int | None = None, first_turn: int | None = None, warm: int | None = None
) -> LocalLayout:
    """The layout ``agentgw serve``'s flags ask for, each flag left out taken from :data:`DEFAULT`.

    ``warm`` (the older flag) counts the engines after the first-turn ones: ``--first-turn 1
    --warm 2`` is ``--engines 3 --first-turn 1``. The split and the role controller are
    :data:`DEFAULT`'s (the config's when it has none, or when the config sets them).
    """
    f = DEFAULT.first_turn if first_turn is None else first_turn
    if f < 0:
        raise LayoutError(f"--first-turn must be >= 0, got {f}")
    if warm is not None:
        if warm < 0:
            raise LayoutError(f"--warm must be >= 0, got {warm}")
        if engines is not None and engines != f + warm:
            raise LayoutError(f"--engines {engines} disagrees with --first-turn {f} + --warm {warm}")
        engines = f + warm
    n = DEFAULT.engines if engines is None else engines
    return LocalLayout(n, f, DEFAULT.split, DEFAULT.role_controller)
