"""A framework release that renames an internal the integration uses, simulated in a real
job: the job finishes, with one warning, an ``integration_degraded`` event and resume off
(never an exception into training). Real ``trainguard run`` jobs of the examples: here
transformers with 1 rank (the failed wrap is each rank's own, before any collective; the
resume-off path it takes is the adapter's, shared with Lightning); Lightning's renamed loop
counter is test_integrations_lightning.py's, in its 2-rank kill job's last attempt (gloo), so
the degraded restore and resume off keep the ranks' collectives matched and rank 0 alone
writes the event. The rename is a user ``sitecustomize`` in the workers (chained by
trainguard's hook) that hides the name from trainguard's code only, so the framework itself
keeps working; ``RENAME_FROM_ATTEMPT`` delays it to a later attempt."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration_jobs import events, job_env, run_example

# A descriptor on the framework class: the framework reads and writes the attribute as
# before; from a trainguard module it is gone, as after a rename.
RENAME = """
import os, sys

def _hidden(owner, name, value_key):
    err = f"{owner.__name__!r} object has no attribute {name!r}"

    def from_trainguard():
        return sys._getframe(2).f_globals.get("__name__", "").startswith("trainguard.")

    class Renamed:
        def __get__(self, obj, cls=None):
            if from_trainguard():
                raise AttributeError(err)
            return value_key(obj, cls)

        def __set__(self, obj, value):
            obj.__dict__["_renamed_" + name] = value

    setattr(owner, name, Renamed())

renamed = os.environ.get("RANK") is not None and int(
    os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
) >= int(os.environ.get("RENAME_FROM_ATTEMPT", "0"))
if renamed and os.environ.get("RENAME") == "lightning":
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    _hidden(_TrainingEpochLoop, "_batches_that_stepped",
            lambda obj, cls: obj.__dict__["_renamed__batches_that_stepped"])
if renamed and os.environ.get("RENAME") == "transformers":
    from transformers import Trainer
    original = Trainer.__dict__["get_batch_samples"]
    _hidden(Trainer, "get_batch_samples", lambda obj, cls: original.__get__(obj, cls))
"""


def renamed_env(tmp_path: Path, framework: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` (a job's) with ``framework``'s internal renamed in its workers."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RENAME)
    env = {**env, "RENAME": framework}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    return env


def assert_degraded(run_dir: Path, stderr: str, framework: str, what: str) -> None:
    [ev] = events(run_dir, "integration_degraded")
    assert ev["framework"] == framework and ev["what"] == what
    assert "has no attribute" in ev["error"]
    assert f"trainguard: {framework} integration: {what} failed" in stderr
    assert "training goes on with resume off" in stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_hf_renamed_batch_fetch_finishes_the_job_with_resume_off(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = run_example(
        run_dir,
        "hf_trainer.py",
        ["--steps", "6", "--save-steps", "100"],
        env=renamed_env(tmp_path, "transformers", job_env()),
        nproc=1,  # the wrap fails on each rank alone: one rank shows it (see the docstring)
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert_degraded(run_dir, p.stderr, "transformers", "wrapping get_batch_samples")
    [attached] = events(run_dir, "integration_attached")
    assert attached["resume"] is False
    assert events(run_dir, "job_finished")[-1]["state"] == "succeeded"
