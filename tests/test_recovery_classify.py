"""Failure classification of worker exits (unit)."""

from __future__ import annotations

from trainguard.core.failures import REQUEUE_EXIT_CODE, FailureKind, classify_exit


def test_signals() -> None:
    assert classify_exit(rank=0, local_rank=0, exitcode=-9).kind is FailureKind.KILLED
    f = classify_exit(rank=1, local_rank=1, exitcode=-11, pid=5)
    assert (f.kind, f.signal, f.pid) == (FailureKind.CRASHED, "SIGSEGV", 5)
    assert classify_exit(rank=0, local_rank=0, exitcode=-15).kind is FailureKind.TERMINATED


def test_exit_codes_and_error_files() -> None:
    assert (
        classify_exit(rank=0, local_rank=0, exitcode=REQUEUE_EXIT_CODE).kind
        is FailureKind.PREEMPTED
    )
    assert classify_exit(rank=0, local_rank=0, exitcode=3).kind is FailureKind.EXITED
    none = classify_exit(rank=0, local_rank=0, exitcode=1, error_file_data={"message": "<NONE>"})
    assert none.kind is FailureKind.EXITED and none.message is None
    data = {"message": {"message": "RuntimeError: boom", "extraInfo": {}}}
    e = classify_exit(rank=0, local_rank=0, exitcode=1, error_file_data=data)
    assert e.kind is FailureKind.EXCEPTION and e.message == "RuntimeError: boom"
