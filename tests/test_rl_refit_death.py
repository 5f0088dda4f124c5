"""Weight sync through an engine's death: kill -9 or SIGSTOP of an engine at 10 %, 50 % and
90 % of its load of the version being pushed (real engine processes: bench/cheap_engine.py,
holding its load at that point; bench/refit_drill.py, the drill bench/rl_fleet.py runs 20
times). The other engines finish the refit, the
trainer's sync call returns within its timeout, and the victim serves the current version
again (restarted after a kill, continued after a freeze)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.refit_drill import RefitDrill
from tests.procs import FIXTURE_PIDS

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefitDrill]:
    # an engine the drill restarts belongs to it (it ends them all at the module's end)
    d = RefitDrill(tmp_path_factory.mktemp("refit"), engines=3, sync_timeout_s=TIMEOUT_S,
                   started=FIXTURE_PIDS.add)  # fmt: skip
    try:
        yield d
    finally:
        d.close()


@pytest.mark.parametrize("kind", ["kill", "stop"])
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_a_refit_goes_through_an_engine_death(
    drill: RefitDrill, kind: str, fraction: float
) -> None:
    victim = {0.1: 0, 0.5: 1, 0.9: 2}[fraction]
    got = drill.case(kind, fraction, victim=victim)
    assert got["loaded_at_fault"] == pytest.approx(fraction, abs=0.051), got
    assert got["timeout_s"] == TIMEOUT_S
    # the trainer's sync call waited no longer than the sync timeout
    assert got["wait_s"] <= TIMEOUT_S, got
    assert got["others_confirmed"] and not got["victim_confirmed"], got
    # the dead or frozen engine rejoined at the current version, with every other engine
    assert got["all_at_version"], got
