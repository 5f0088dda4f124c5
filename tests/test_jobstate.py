"""JobState: the one set of states the launcher's Outcome, a plugin's AgentExit and the Slurm
batch script's decision share, written as plain strings in the event log."""

from __future__ import annotations

import json

import pytest

from trainguard.core.config.slurm import SlurmConfig
from trainguard.core.contracts.jobstate import JobState
from trainguard.core.plugin import AgentExit, JobStopError, NodeEvictedError, NodeUnhealthyError
from trainguard.runtime.launcher import Outcome
from trainguard.slurm.finish import FinishAction, decide


def test_a_state_is_its_string() -> None:
    s = JobState.DO_NOT_REQUEUE
    assert s == "do_not_requeue" and str(s) == "do_not_requeue" and f"{s}" == "do_not_requeue"
    assert json.loads(json.dumps({"state": s})) == {"state": "do_not_requeue"}
    assert "do_not_requeue" in {s} and {s: 1}["do_not_requeue"] == 1


def test_signals() -> None:
    assert JobState.of_signal("SIGTERM") is JobState.SIGTERM
    assert JobState.of_signal("SIGWINCH") is JobState.SIGNALLED


def test_agent_exits_carry_job_states() -> None:
    assert AgentExit.state is JobState.FAILED
    assert NodeUnhealthyError.state is JobState.EXCLUDED
    assert NodeEvictedError.state is JobState.EVICTED
    assert JobStopError.state is JobState.DO_NOT_REQUEUE


def test_outcome_takes_a_string_state_and_refuses_an_unknown_one() -> None:
    assert Outcome("requeue").state is JobState.REQUEUE  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Outcome("no_such_state")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "action"),
    [
        (JobState.SUCCEEDED, FinishAction.DONE),
        (JobState.DO_NOT_REQUEUE, FinishAction.STOP),
        (JobState.REQUEUE, FinishAction.REQUEUE),
        (JobState.FAILED, FinishAction.FAIL),
    ],
)
def test_slurm_decides_on_the_states_the_agents_wrote(
    state: JobState, action: FinishAction
) -> None:
    # the states come back from events.jsonl as plain strings
    states = {"n1": json.loads(json.dumps(state))}
    got = decide(rc=1, states=states, allocation=["n1"], cfg=SlurmConfig(), resubmits=0)
    assert got.action is action
