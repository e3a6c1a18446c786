"""Retention policies are pure: table-driven checks of what each keeps."""

from __future__ import annotations

import pytest

from engine_ext.retention import IntervalRetention, Offer, SelectiveRetention, make_retention

A, B, C, S1, S2 = (bytes([i]) * 4 for i in range(5))


@pytest.mark.parametrize(
    ("policy", "steps", "expected"),
    [
        # interval: every attention chunk of each turn is kept
        (IntervalRetention(), [[Offer(A, 0), Offer(B, 0)]], [[A, B]]),
        # interval on a hybrid: only the turn-end state checkpoint of group 1 is kept
        (
            IntervalRetention(state_groups=frozenset({1})),
            [[Offer(A, 0), Offer(S1, 1), Offer(B, 0), Offer(S2, 1)]],
            [[A, B, S2]],
        ),
        # selective: first sighting is not kept, the second is
        (SelectiveRetention(), [[Offer(A, 0)], [Offer(A, 0)]], [[], [A]]),
        # selective with a higher bar
        (SelectiveRetention(min_sightings=3), [[Offer(A, 0)], [Offer(A, 0)], [Offer(A, 0)]], [[], [], [A]]),
        # selective: the table is bounded; a forgotten key starts over
        (SelectiveRetention(capacity=1), [[Offer(A, 0)], [Offer(B, 0)], [Offer(A, 0)]], [[], [], []]),
    ],
)
def test_retention_keeps(policy, steps, expected) -> None:
    assert [policy.select(step) for step in steps] == expected


def test_selective_counts_a_lookup_as_a_sighting() -> None:
    policy = SelectiveRetention()
    policy.observe_lookup(C)
    assert policy.select([Offer(C, 0)]) == [C]


@pytest.mark.parametrize(
    ("config", "kind"),
    [(None, IntervalRetention), ({"policy": "selective", "min_sightings": 2}, SelectiveRetention)],
)
def test_make_retention_from_config(config, kind) -> None:
    assert isinstance(make_retention(config), kind)


@pytest.mark.parametrize(
    "config", [{"policy": "lfu"}, {"policy": "interval", "x": 1}, {"policy": "selective", "y": 2}]
)
def test_make_retention_rejects_unknown_settings(config) -> None:
    with pytest.raises(ValueError):
        make_retention(config)
