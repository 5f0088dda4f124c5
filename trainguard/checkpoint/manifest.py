"""The on-disk layout, the atomic commit, and retention.

::

    <root>/
      step_00000055/            DCP files of step 55 (__0_0.distcp, __1_0.distcp, .metadata)
        manifest.json           present only once every rank's files are durable: the commit
      latest                    name of the newest committed step directory (a convenience;
                                readers trust manifests, not this pointer)

A checkpoint is *committed* iff its ``manifest.json`` exists and parses. The manifest is
written to a temporary name, fsynced, and renamed into place by rank 0 after every rank
reported its files fsynced with their sizes and CRC32s. Deleting starts by removing the
manifest, so a half-deleted checkpoint is never taken for a committed one.
"""

from __future__ import annotations

import json
import logging
import platform
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from trainguard.checkpoint.storage import Storage

__all__ = [
    "MANIFEST",
    "Manifest",
    "VerifyError",
    "commit",
    "committed_steps",
    "read_manifest",
    "retention_victims",
    "step_dir_name",
    "verify",
]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8,})$")


class VerifyError(RuntimeError):
    """A committed checkpoint's files do not match its manifest."""


@dataclass(kw_only=True, slots=True)
class Manifest:
    step: int
    world_size: int
    files: dict[str, dict[str, int]]
    """File name (relative to the step directory) → {"size": bytes, "crc32": int}."""
    time: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    versions: dict[str, str] = field(default_factory=dict)
    """torch, trainguard and python versions that wrote it."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        d = json.loads(data)
        return cls(**d)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def versions() -> dict[str, str]:
    import torch

    from trainguard.core.version import __version__

    return {
        "torch": torch.__version__,
        "trainguard": __version__,
        "python": platform.python_version(),
    }


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def step_dirs(storage: Storage, root: str) -> dict[int, str]:
    """Every step directory (committed or not), step → path."""
    out = {}
    for name in storage.list_dir(root):
        m = _STEP_RE.match(name)
        if m:
            out[int(m.group(1))] = _join(root, name)
    return out


def read_manifest(storage: Storage, step_path: str) -> Manifest | None:
    try:
        return Manifest.from_json(storage.read_bytes(_join(step_path, MANIFEST)))
    except (OSError, ValueError, TypeError) as e:
        if not isinstance(e, FileNotFoundError):
            logger.warning("unreadable manifest in %s: %s", step_path, e)
        return None


def committed_steps(storage: Storage, root: str) -> list[int]:
    """Steps with a readable manifest, oldest first."""
    return [
        s
        for s, p in sorted(step_dirs(storage, root).items())
        if read_manifest(storage, p) is not None
    ]


def commit(storage: Storage, root: str, manifest: Manifest) -> str:
    """Make ``manifest.step`` visible: rename the manifest into place (the commit), then point
    ``latest`` at it. Raises ``OSError`` only if the manifest was not renamed in: once it is,
    the checkpoint is committed and a failure to write ``latest`` (a convenience) is logged."""
    path = _join(root, step_dir_name(manifest.step))
    storage.write_atomic(_join(path, MANIFEST), manifest.to_json())
    try:
        storage.write_atomic(_join(root, LATEST), step_dir_name(manifest.step).encode())
    except OSError as e:
        logger.warning(
            "checkpoint step %s is committed, but %s could not point at it: %s",
            manifest.step,
            _join(root, LATEST),
            e,
        )
    return path


def verify(
    storage: Storage, step_path: str, manifest: Manifest, names: list[str], *, threads: int = 1
) -> None:
    """Check size and CRC32 of ``names`` (a subset of ``manifest.files``); raise VerifyError.
    ``threads`` files are checked at once (CRC32 releases the GIL)."""

    def check(name: str) -> str | None:
        want = manifest.files[name]
        try:
            size, crc = storage.checksum(_join(step_path, name))
        except OSError as e:
            return f"{name}: {e}"
        if size != want["size"] or crc != want["crc32"]:
            return (
                f"{name}: size {size} crc32 {crc:#010x}, manifest says size {want['size']} "
                f"crc32 {want['crc32']:#010x}"
            )
        return None

    if threads > 1 and len(names) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(names))) as ex:
            errors = [e for e in ex.map(check, names) if e]
    else:
        errors = [e for e in map(check, names) if e]
    if errors:
        raise VerifyError("; ".join(errors))


def retention_victims(
    committed: list[int], *, keep_last: int, keep_every_steps: int = 0
) -> list[int]:
    """Committed steps to delete: all but the newest ``keep_last`` and multiples of
    ``keep_every_steps``. The newest committed is always kept; uncommitted ones are never
    passed in, so never touched."""
    if not committed:
        return []
    steps = sorted(committed)
    keep = set(steps[-max(keep_last, 1) :])
    if keep_every_steps > 0:
        keep.update(s for s in steps if s % keep_every_steps == 0)
    return [s for s in steps if s not in keep]
