"""torch private internals the layers below the runtime use (checkpoint, worker).

The runtime's are in ``trainguard.runtime._torch``; this module holds the few that the
checkpoint feature and the worker need, because the layering (docs/architecture.md) lets them
import the core but not the runtime. Each name is listed in :data:`PRIVATES`, and a test
asserts it exists on the installed torch. torch is imported lazily: importing the core does
not import torch.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = [
    "PRIVATES",
    "abort_backend",
    "dump_fr_trace_json",
    "fsspec_reader",
    "fsspec_writer",
    "record_error_file",
]

PRIVATES: tuple[tuple[str, str, str], ...] = (
    # (module, class or "" for the module itself, private name)
    ("torch.distributed.checkpoint._fsspec_filesystem", "", "FsspecReader"),
    ("torch.distributed.checkpoint._fsspec_filesystem", "", "FsspecWriter"),
    ("torch.distributed", "ProcessGroup", "_get_backend"),
    ("torch._C._distributed_c10d", "", "_dump_fr_trace_json"),
    ("torch.distributed.elastic.multiprocessing.errors", "ErrorHandler", "_get_error_file_path"),
)
"""Every torch private the core provides: (module, class or "", name). The first two are
public names in a private module (``_fsspec_filesystem``), used where torch has no public
``fsspec_filesystem`` module (torch 2.15 has it and deprecates the private one)."""


def _fsspec_filesystem() -> Any:
    """torch's DCP fsspec module: the public one where it exists, else the private one."""
    try:
        return importlib.import_module("torch.distributed.checkpoint.fsspec_filesystem")
    except ImportError:
        return importlib.import_module("torch.distributed.checkpoint._fsspec_filesystem")


def fsspec_writer(path: str, *, sync_files: bool) -> Any:
    """torch's DCP ``FsspecWriter`` for ``path`` (an fsspec URL)."""
    return _fsspec_filesystem().FsspecWriter(path, sync_files=sync_files)


def fsspec_reader(path: str) -> Any:
    """torch's DCP ``FsspecReader`` for ``path`` (an fsspec URL)."""
    return _fsspec_filesystem().FsspecReader(path)


def abort_backend(group: Any, device: Any) -> None:
    """Abort ``group``'s communicator for ``device`` (e.g. NCCL's), unblocking its collectives."""
    group._get_backend(device).abort()


def dump_fr_trace_json(include_collectives: bool) -> bytes:
    """This process's flight-recorder trace, as torch's JSON dump (bytes)."""
    from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

    return _dump_fr_trace_json(include_collectives, False)


def record_error_file(exc: BaseException) -> None:
    """torch's ``ErrorHandler.record_exception`` (call it while ``exc`` is being handled: it
    takes that traceback), written under a temporary name and renamed into place: the agent
    reads the error file once the worker has exited, and a worker killed while writing it
    must leave no file rather than half of one (torch's reader fails on it)."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class _Staged(ErrorHandler):
        def _get_error_file_path(self) -> str | None:
            path = super()._get_error_file_path()
            return f"{path}.tmp" if path else None

    path = ErrorHandler()._get_error_file_path()
    _Staged().record_exception(exc)
    if path:
        os.replace(f"{path}.tmp", path)
