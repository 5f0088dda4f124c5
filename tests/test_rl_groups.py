"""Group integrity (trainguard.rl.groups): a group is trained complete, shrunk to >= 2
survivors by setting (advantages over them alone), or dropped whole by reason; never padded.
The per-sample record and the report's staleness histogram. (The trainer under kill -9 with
these records: tests/test_rl_resume.py.)"""

from __future__ import annotations

import re

import pytest
import torch

from trainguard.core.contracts.event_kinds import ROLLOUT_SAMPLES_TRAINED
from trainguard.rl.groups import SampleRecord, advantages, settle
from trainguard.rl.rollout_types import Completion
from trainguard.telemetry.report_rl import samples_section


def c(p: int, j: int, version: int = 5, engine: str = "http://e0") -> Completion:
    return Completion(p, f"s{j}", [p, j], None, "length", version, 0, engine)


def test_complete_groups_are_kept_and_a_group_with_a_lost_member_is_dropped_whole() -> None:
    twice = c(2, 1)
    groups = [
        [c(0, j) for j in range(4)],  # complete
        [c(1, j) for j in range(3)],  # a member failed
        [c(2, 0), twice, twice, c(2, 3)],  # padded with a repeat
        [c(3, 0, version=3), *[c(3, j) for j in range(1, 4)]],  # one too stale for k=1
        [c(4, 0, engine=""), *[c(4, j) for j in range(1, 4)]],  # not an engine's
        [],  # its request ran out of attempts
    ]
    out = settle(groups, n=4, train_version=5, max_staleness=1)
    assert [gi for gi, _ in out.kept] == [0]
    assert out.dropped == {"failed": 2, "duplicate": 1, "stale": 1, "not_generated": 1}
    assert out.shrunk == 0 and len(out.samples) == 4


def test_shrink_keeps_at_least_two_survivors_and_never_pads() -> None:
    twice = c(2, 0)
    groups = [
        [c(0, 0), c(0, 1), c(0, 2, version=1)],  # 2 survivors: shrunk
        [c(1, 0), c(1, 1, version=1), c(1, 2, version=1)],  # 1 survivor: dropped
        [twice, twice, c(2, 1)],  # the repeat is not a member
        [c(3, 0), c(3, 0), c(3, 1)],  # two samples that read the same: both members
    ]
    out = settle(groups, n=3, train_version=5, max_staleness=2, policy="shrink")
    assert [(gi, len(g)) for gi, g in out.kept] == [(0, 2), (2, 2), (3, 3)]
    assert out.shrunk == 2 and out.dropped == {"stale": 1}
    for _, g in out.kept:  # every member a sample of its own, real: no padding
        assert len({id(m) for m in g}) == len(g) and all(m.engine for m in g)
    with pytest.raises(ValueError, match="group policy"):
        settle(groups, n=3, train_version=5, max_staleness=0, policy="pad")


def test_advantages_are_recomputed_over_the_survivors() -> None:
    full = [1.0, 0.0, 0.5, 0.25]
    a = advantages(full[:2])  # the survivors alone
    r = torch.tensor(full[:2])
    assert a == pytest.approx(((r - r.mean()) / (r.std() + 1e-4)).tolist(), rel=1e-6)
    assert sum(a) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError):
        advantages([1.0])


def test_the_record_and_the_report_histogram() -> None:
    events: list[dict[str, object]] = []
    rec = SampleRecord(lambda kind, **f: events.append({"kind": kind, **f}), rank=1, bound=1)
    groups = [[c(0, j, version=4) for j in range(2)], [c(1, j, version=5) for j in range(2)],
              [c(2, 0, version=2), c(2, 1)]]  # fmt: skip
    figs = rec.trained(7, 5, settle(groups, n=2, train_version=5, max_staleness=1))
    assert figs["groups_dropped_stale"] == 1 and figs["staleness_max"] == 1
    (e,) = events
    assert e["kind"] == ROLLOUT_SAMPLES_TRAINED and e["staleness"] == [1, 1, 0, 0]
    assert e["group_sizes"] == [2, 2] and e["dropped"] == {"stale": 1} and e["bound"] == 1
    html = samples_section(events)
    bars = dict(re.findall(r'data-value="(\d+)" data-count="(\d+)"', html))
    assert bars == {"0": "2", "1": "2"}
    assert "groups dropped: stale</td><td>1" in html and "tg-limit" in html
    assert samples_section([{"kind": "other"}]) == ""
