"""Leaving the process group at the end of a job: every rank together, and without the
teardown deadlock of torch's gloo backend.

torch's gloo process group joins its worker threads in its destructor, which runs on the thread
that drops its last reference: the main thread, holding the GIL, when the script's
``DistributedDataParallel`` module goes away at the end. A worker thread that is still freeing
the last barrier's work at that moment (that work holds the last all-reduces of the backward
pass, whose captured thread-local state holds a Python object: torch's autograd stashes its
context there) waits for the GIL: a deadlock, seen as a rank that finished its steps and never
exits while its peers wait in torch's exit barrier. :func:`destroy_process_group` keeps that
work referenced until the interpreter's exit handlers run, after the group's threads were
joined, so that the main thread frees it.
"""

from __future__ import annotations

import atexit

__all__ = ["destroy_process_group"]

_held: list[object] = []
"""The closing barriers' works (``torch.distributed.Work``), freed at exit."""


def destroy_process_group() -> None:
    """A barrier every rank joins, then ``torch.distributed.destroy_process_group()``; nothing
    where no process group is initialised. Call it where a script would call those two."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    work = dist.barrier(async_op=True)
    if not _held:
        atexit.register(_held.clear)
    _held.append(work)
    work.wait()
    dist.destroy_process_group()
