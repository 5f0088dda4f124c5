"""Failure classification: a worker's exit (code, signal, error file) → a failure kind."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "DO_NOT_REQUEUE_EXIT_CODE",
    "EVICTED_EXIT_CODE",
    "FailureKind",
    "REQUEUE_EXIT_CODE",
    "ROLE_BELOW_FLOOR_EXIT_CODE",
    "WorkerFailure",
    "classify_exit",
    "peer_failure",
    "peer_failure_text",
]

REQUEUE_EXIT_CODE = 75
"""A worker that saved its state after a preemption signal exits with this code (EX_TEMPFAIL)."""

DO_NOT_REQUEUE_EXIT_CODE = 93
"""``trainguard run`` exits with this code when running the job again cannot help (a
deterministic failure, a crash loop): a Slurm batch script from ``trainguard sbatch`` then ends
the job instead of requeueing or resubmitting it (the same value as NVIDIA's resiliency
extension uses)."""

SDC_EXIT_CODE = 95
"""A worker whose rank the replicas' check (``[sdc]``) named as having computed a wrong result
exits with this code in a job of several nodes: its node's agent attributes the round to
``sdc`` and evicts the node, as for a health drain (a spare, or the nodes left, go on from the
last agreed checkpoint)."""

EVICTED_EXIT_CODE = 94
"""``trainguard run`` exits with this code on a node the recovery policy evicted from the job
(a health ``drain``/``fail`` verdict, or the node failing too often), and on a node whose agent
was started again while the node is still on the job's blocklist. The job goes on without the
node: a scheduler must not retry the *node* (the job itself is not over)."""

ROLE_BELOW_FLOOR_EXIT_CODE = 96
"""``trainguard run`` exits with this code when a role (``[roles.<name>]``) fell below its
serving ``floor``: replicas retired, or lost with their role node and no spare node left to
run them again. Not a user error (2) and not a training failure: the fleet is gone. One line
names the role, the floor and what was lost."""


class FailureKind(str, Enum):
    """Why a worker stopped.

    ``KILLED`` (SIGKILL: OOM killer, kill -9, hang recovery), ``CRASHED`` (SIGSEGV/SIGBUS/
    SIGABRT/SIGILL/SIGFPE), ``TERMINATED`` (SIGTERM/SIGINT/SIGHUP), ``EXCEPTION`` (non-zero exit
    with a Python error file), ``EXITED`` (non-zero exit, no error file), ``PREEMPTED`` (exited
    with :data:`REQUEUE_EXIT_CODE`), ``UNKNOWN``. A hung group the agent ends is ``KILLED``
    (its ``hang_detected``/``hang_killed`` events say why).
    """

    KILLED = "killed"
    CRASHED = "crashed"
    TERMINATED = "terminated"
    EXCEPTION = "exception"
    EXITED = "exited"
    PREEMPTED = "preempted"
    UNKNOWN = "unknown"


_SIGNAL_KIND = {
    signal.SIGKILL: FailureKind.KILLED,
    signal.SIGSEGV: FailureKind.CRASHED,
    signal.SIGBUS: FailureKind.CRASHED,
    signal.SIGABRT: FailureKind.CRASHED,
    signal.SIGILL: FailureKind.CRASHED,
    signal.SIGFPE: FailureKind.CRASHED,
    signal.SIGTERM: FailureKind.TERMINATED,
    signal.SIGINT: FailureKind.TERMINATED,
    signal.SIGHUP: FailureKind.TERMINATED,
}


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    rank: int
    local_rank: int
    exitcode: int
    signal: str | None
    kind: FailureKind
    message: str | None = None
    pid: int | None = None
    callstack: str | None = None
    """The error file's traceback (``py_callstack``), when it has one."""
    output_tail: str | None = None
    """The last lines the worker wrote to stderr, when torch captured them to a file."""
    torn_down: bool = False
    """The worker was still running when its agent ended the group (a consequence)."""


_NO_ERROR_FILE = "<NONE>"  # torch's placeholder when a worker wrote no error file


def _error_message(error_file_data: Any) -> str | None:
    if not isinstance(error_file_data, dict):
        return None
    msg = error_file_data.get("message")
    if isinstance(msg, dict):
        msg = msg.get("message")
    if not msg or msg == _NO_ERROR_FILE:
        return None
    return str(msg)[:2000]


def _callstack(error_file_data: Any) -> str | None:
    if not isinstance(error_file_data, dict):
        return None
    msg = error_file_data.get("message")
    info = msg.get("extraInfo") if isinstance(msg, dict) else None
    stack = info.get("py_callstack") if isinstance(info, dict) else None
    return str(stack)[-8000:] if stack else None


def classify_exit(
    *,
    rank: int,
    local_rank: int,
    exitcode: int,
    error_file_data: Any = None,
    pid: int | None = None,
    output_tail: str | None = None,
    torn_down: bool = False,
) -> WorkerFailure:
    """Classify one worker exit as reported by torch's ``ProcessFailure``."""
    sig_name: str | None = None
    message = _error_message(error_file_data)
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
            sig_name = sig.name
            kind = _SIGNAL_KIND.get(sig, FailureKind.UNKNOWN)
        except ValueError:
            kind = FailureKind.UNKNOWN
    elif exitcode == REQUEUE_EXIT_CODE:
        kind = FailureKind.PREEMPTED
    elif message is not None:
        kind = FailureKind.EXCEPTION
    elif exitcode != 0:
        kind = FailureKind.EXITED
    else:
        kind = FailureKind.UNKNOWN
    return WorkerFailure(
        rank,
        local_rank,
        exitcode,
        sig_name,
        kind,
        message,
        pid,
        _callstack(error_file_data),
        output_tail,
        torn_down,
    )


# What gloo and NCCL say when the rank at the other end of a collective died: on a survivor
# such an error is a consequence of a failure elsewhere, not a failure of its own.
_PEER_LOSS = (
    ("connection reset by peer", "connection reset by peer"),
    ("connection closed by peer", "connection closed by peer"),
    ("broken pipe", "broken pipe"),
    ("remote process exited", "remote process exited"),
    ("nccl communicator was aborted", "NCCL communicator aborted"),
)


def peer_failure(exc: BaseException) -> str | None:
    """A short reason when ``exc`` is a collective that failed because a peer rank died (the
    survivor's view of a failure elsewhere); None for any other error."""
    return peer_failure_text(str(exc))


def peer_failure_text(text: str) -> str | None:
    """:func:`peer_failure` on an error message (e.g. a worker's error file)."""
    text = text.lower()
    for needle, reason in _PEER_LOSS:
        if needle in text:
            return reason
    return None
