"""The overhead benchmark's agentic body mix: shared system prompt, growing turns, written once."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from benchmarks.overhead import CHARS_PER_TOKEN, PASS_MARK, Bodies, agentic_bodies, small_body


def test_agentic_sessions_share_the_system_prompt_and_grow_turn_by_turn() -> None:
    reqs = agentic_bodies(sessions=3, turns=4, first_tokens=2_000, last_tokens=8_000, system_tokens=1_000)
    assert [sid for sid, _ in reqs] == [f"bench-s{s}" for _ in range(4) for s in range(3)]
    bodies = [json.loads(b) for _, b in reqs]
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) == 1 and bodies[0]["messages"][0]["role"] == "system"
    for s in range(3):
        turns = [bodies[t * 3 + s]["messages"] for t in range(4)]
        for prev, nxt in itertools.pairwise(turns):
            assert nxt[: len(prev)] == prev  # each turn resends the last one and adds to it
            assert [m["role"] for m in nxt[len(prev) :]] == ["assistant", "user"]
        chars = [sum(len(m["content"]) for m in t) for t in turns]
        assert abs(chars[0] / CHARS_PER_TOKEN - 2_000) < 50
        assert abs(chars[-1] / CHARS_PER_TOKEN - 8_000) < 100
    # sessions differ after the shared prompt
    assert bodies[0]["messages"][1] != bodies[1]["messages"][1]


def test_bodies_write_one_file_per_single_body_and_an_index_for_a_mix(tmp_path: Path) -> None:
    mix = agentic_bodies(sessions=2, turns=2, first_tokens=1_000, last_tokens=2_000, system_tokens=500)
    b = Bodies(tmp_path, {"small": [(None, small_body())], "agentic": list(mix)})
    b.write()
    script, args = b.wrk_args("small")
    assert script.name == "post.lua" and Path(args[0]).read_bytes() == small_body()
    script, args = b.wrk_args("agentic")
    assert script.name == "bodies.lua" and script.exists() and len(args) == 1
    lines = [line.split() for line in Path(args[0]).read_text().splitlines()]
    assert [sid for _, sid in lines] == [sid for sid, _ in mix]
    assert [Path(p).read_bytes() for p, _ in lines] == [body for _, body in mix]
    assert b.sizes_note()["agentic"].startswith("4 bodies")


def test_turns_bodies_carry_one_pass_mark_and_each_wrk_run_gets_passes_of_its_own(tmp_path: Path) -> None:
    mix = agentic_bodies(
        sessions=2, turns=3, first_tokens=1_000, last_tokens=2_000, system_tokens=500, mark=PASS_MARK
    )
    for _, body in mix:
        assert body.count(PASS_MARK.encode()) == 1
        first_user = json.loads(body)["messages"][1]
        assert first_user["role"] == "user" and first_user["content"].startswith(PASS_MARK)
    b = Bodies(tmp_path, {"turns": list(mix)})
    b.write()
    script, first = b.wrk_args("turns")
    _, second = b.wrk_args("turns")
    assert script.name == "bodies.lua"
    assert first[1] == second[1] == PASS_MARK
    assert int(second[2]) - int(first[2]) >= 10_000  # no pass number is sent twice
