"""torch's error file, written for an uncaught exception, and read back for failure attribution.

torch's ``@record`` writes a worker's exception to ``TORCHELASTIC_ERROR_FILE`` (JSON:
``{"message": {"message": "<Type>: <text>", "extraInfo": {"py_callstack": <traceback>,
"timestamp": <unix s>}}}``, :meth:`ErrorHandler.record_exception`); a script without it leaves
no file, and its agent knows only an exit code. The workers' start-up hook (runtime/_zygote)
calls :func:`install_excepthook`: an exception that ends the script is written in torch's
format (unless ``@record`` already wrote the file), then Python's own hook prints it as usual.

:func:`exception_site` reads a traceback back: the exception's type and the innermost frame in
the user's own code (not the standard library, not an installed package), the "place" failure
attribution compares across ranks and attempts.

Standard library only: the hook imports this before the script runs.
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
import time
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

__all__ = ["ERROR_FILE_ENV", "ExceptionSite", "exception_site", "install_excepthook"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""Where torch's agent expects a worker's error file (torch sets it per worker)."""

_installed = False


def _write(path: str, exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    data = {
        "message": {
            "message": f"{exc_type.__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc_type, exc, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    from trainguard.core.atomicfile import write_atomic

    write_atomic(path, json.dumps(data))  # no planted symlink followed


def record_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> bool:
    """Write torch's error file for an exception that ends the process; False when there is
    nowhere to write it, it is not an error (``KeyboardInterrupt``), or ``@record`` already did."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or not issubclass(exc_type, Exception) or os.path.exists(path):
        return False
    try:
        _write(path, exc_type, exc, tb)
    except Exception as e:  # never hide the user's exception behind ours
        print(f"trainguard: could not write the error file {path}: {e}", file=sys.stderr)
        return False
    return True


def install_excepthook() -> None:
    """Record uncaught exceptions as torch's error file, then run the hook that was there."""
    global _installed
    if _installed or not os.environ.get(ERROR_FILE_ENV):
        return
    _installed = True
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        record_uncaught(exc_type, exc, tb)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


# -- reading it back ---------------------------------------------------------------------------

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+?)\s*$')
_HEAD = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<text>.*))?$")


def _library_paths() -> tuple[str, ...]:
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    return tuple(sorted(p for p in paths if p))


_LIBRARY = _library_paths()


def _is_library(path: str) -> bool:
    return (
        path.startswith("<")
        or "site-packages" in path
        or "dist-packages" in path
        or any(path.startswith(p) for p in _LIBRARY)
    )


@dataclass(frozen=True, slots=True)
class ExceptionSite:
    """An exception and where it was raised in the user's code."""

    type: str
    """The exception's type name (no module: ``RuntimeError``)."""
    text: str
    """The first line of its message."""
    file: str | None
    """The innermost frame in the user's own code (None: every frame is library code)."""
    line: int | None
    func: str | None
    raised_in: str | None
    """The innermost frame of all (where it was raised: often inside torch)."""

    @property
    def place(self) -> str:
        return f"{self.file}:{self.line}" if self.file else (self.raised_in or "?")

    def signature(self) -> str:
        """Type and place: equal on every rank that hit the same bug, whatever the message."""
        return f"{self.type}@{self.place}"


def exception_site(message: str | None, callstack: str | None) -> ExceptionSite | None:
    """The exception of an error file (its message, and its ``py_callstack`` when there is
    one); None when neither names one."""
    frames: list[tuple[str, int, str]] = []
    head: str | None = None
    for line in (callstack or "").splitlines():
        m = _FRAME.match(line)
        if m:
            frames.append((m["file"], int(m["line"]), m["func"]))
            continue
        if line and not line[0].isspace() and _HEAD.match(line.strip()) and frames:
            head = line.strip()  # the last such line after the frames: "Type: text"
    if head is None and message:
        head = message.strip().splitlines()[0] if message.strip() else None
    if not head:
        return None
    m = _HEAD.match(head)
    if m is None:
        return None
    typ = m["type"].rsplit(".", 1)[-1]
    text = (m["text"] or "").strip()
    if not text and message:
        text = message.strip().splitlines()[0]
    user = [f for f in frames if not _is_library(f[0])]
    file, line_no, func = user[-1] if user else (None, None, None)
    raised = f"{frames[-1][0]}:{frames[-1][1]}" if frames else None
    return ExceptionSite(typ, text[:300], file, line_no, func, raised)
