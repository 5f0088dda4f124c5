"""Staging: flatten a state into tensors + a skeleton, copy the tensors into host buffers that
are allocated once and reused, and (for the memory tier) publish them as a snapshot file.

A *slot* is one set of host buffers big enough for the whole state of this rank. Each tensor
gets its own storage (``torch.frombuffer`` on a slice of an ``mmap``, or ``torch.empty``), so
DCP can ``torch.save`` a staged tensor without cloning it. With a memory tier the slot lives in
a file under the agent's shared-memory directory::

    <memory_dir>/rank_<r>/slot<i>.bin    the tensors' bytes (64-byte aligned)
    <memory_dir>/rank_<r>/slot<i>.json   the snapshot's metadata; written (atomically) only after
                                         the bytes are complete, removed before they change

so a crash at any point leaves either a complete snapshot or none in that slot.
"""

from __future__ import annotations

import copy
import ctypes
import json
import logging
import mmap
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint import jsoncodec
from trainguard.core.atomicfile import write_atomic

__all__ = [
    "Layout",
    "Slot",
    "SlotPool",
    "Snapshot",
    "decode_skeleton",
    "flatten",
    "list_snapshots",
    "unflatten",
    "views_of",
]

logger = logging.getLogger(__name__)

_ALIGN = 64


@dataclass(frozen=True, slots=True)
class _Ref:
    index: int


jsoncodec.register_ref("ref", _Ref, lambda r: r.index, lambda v: _Ref(int(v)))


@dataclass(frozen=True, slots=True)
class _DTensorInfo:
    mesh: Any
    placements: Any
    shape: tuple[int, ...]
    stride: tuple[int, ...]


_IMMUTABLE = frozenset({int, float, str, bytes, bool, complex, type(None)})


def flatten(obj: Any, *, copy_leaves: bool = False) -> tuple[Any, list[torch.Tensor]]:
    """Replace every tensor in a nest of dicts/lists/tuples by a ``_Ref``; return (skeleton,
    tensors). The skeleton's containers are new; ``copy_leaves``: so are its mutable
    non-tensor leaves (deep copies: the skeleton keeps their values as of now)."""
    tensors: list[torch.Tensor] = []

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            tensors.append(o)
            return _Ref(len(tensors) - 1)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple):
            return tuple(walk(v) for v in o)
        if copy_leaves and type(o) not in _IMMUTABLE:
            return copy.deepcopy(o)
        return o

    return walk(obj), tensors


def unflatten(skeleton: Any, tensors: list[Any]) -> Any:
    def walk(o: Any) -> Any:
        if isinstance(o, _Ref):
            return tensors[o.index]
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple):
            return tuple(walk(v) for v in o)
        return o

    return walk(skeleton)


def ref_paths(skeleton: Any) -> dict[int, tuple[Any, ...]]:
    """Tensor index → its key path in the nest."""
    out: dict[int, tuple[Any, ...]] = {}

    def walk(o: Any, path: tuple[Any, ...]) -> None:
        if isinstance(o, _Ref):
            out[o.index] = path
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, (*path, k))
        elif isinstance(o, list | tuple):
            for i, v in enumerate(o):
                walk(v, (*path, i))

    walk(skeleton, ())
    return out


def decode_skeleton(text: Any, num_tensors: int) -> Any:
    """The skeleton of a snapshot's metadata, decoded (JSON, never pickle); ``ValueError`` if it
    is malformed in any way, or refers to a tensor the snapshot does not have."""
    if not isinstance(text, str):
        raise ValueError("snapshot skeleton: expected a JSON string")
    try:
        skeleton = jsoncodec.loads(text)
        refs = ref_paths(skeleton)
    except Exception as e:  # noqa: BLE001 - hostile input: any decode failure is a refusal
        raise ValueError(f"snapshot skeleton is malformed: {type(e).__name__}: {e}") from None
    bad = [i for i in refs if not (type(i) is int and 0 <= i < num_tensors)]
    if bad:
        raise ValueError(
            f"snapshot skeleton refers to tensor {bad[0]!r}; the snapshot has {num_tensors}"
        )
    return skeleton


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _dtensor_info(t: torch.Tensor) -> _DTensorInfo | None:
    if not hasattr(t, "device_mesh"):
        return None
    return _DTensorInfo(t.device_mesh, t.placements, tuple(t.shape), tuple(t.stride()))  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each tensor of a flattened state sits in a slot."""

    entries: tuple[tuple[str, tuple[int, ...], int, int], ...]
    """(dtype name, shape, offset, nbytes) per tensor."""
    nbytes: int

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> Layout:
        entries = []
        off = 0
        for t in tensors:
            lt = local_tensor(t)
            n = lt.numel() * lt.element_size()
            entries.append((str(lt.dtype).removeprefix("torch."), tuple(lt.shape), off, n))
            off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        return cls(tuple(entries), off)

    @classmethod
    def from_entries(cls, entries: list[list[Any]], nbytes: int) -> Layout:
        """The layout written into a snapshot's JSON metadata (``[dtype, shape, off, n]``)."""
        return cls(tuple((e[0], tuple(e[1]), e[2], e[3]) for e in entries), nbytes)


def views_of(buf: Any, layout: Layout) -> list[torch.Tensor]:
    views = []
    for dtype, shape, off, n in layout.entries:
        dt = jsoncodec.dtype_of(dtype)
        if n == 0:
            views.append(torch.empty(shape, dtype=dt))
            continue
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=off)
        views.append(raw.view(dt).view(shape))
    return views


class Slot:
    """One reusable set of host buffers (see module doc)."""

    def __init__(self, index: int, layout: Layout, *, directory: Path | None, pin: bool) -> None:
        self.index = index
        self.layout = layout
        self.directory = directory
        self.persisting = False
        self.step: int | None = None
        self.time = 0.0
        self._mm: mmap.mmap | None = None
        self._registered = False
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self.invalidate()
            size = max(layout.nbytes, 1)
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(self.bin_path, flags, 0o600)
            try:
                # allocate now: a full tmpfs fails here with ENOSPC, not later with SIGBUS
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            if pin and torch.cuda.is_available():
                addr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
                rc = torch.cuda.cudart().cudaHostRegister(addr, size, 1)  # cudaHostRegisterPortable
                self._registered = int(rc) == 0
            self.views = views_of(self._mm, layout)
        else:
            pin = pin and torch.cuda.is_available()
            self.views = [
                torch.empty(shape, dtype=jsoncodec.dtype_of(dt), pin_memory=pin)
                for dt, shape, _, _ in layout.entries
            ]

    @property
    def bin_path(self) -> Path:
        assert self.directory is not None
        return self.directory / f"slot{self.index}.bin"

    @property
    def meta_path(self) -> Path:
        assert self.directory is not None
        return self.directory / f"slot{self.index}.json"

    def invalidate(self) -> None:
        """Before the bytes change: the slot stops being a snapshot."""
        self.step = None
        if self.directory is not None:
            try:
                os.unlink(self.meta_path)
            except FileNotFoundError:
                pass

    def publish(self, *, step: int, rank: int, world_size: int, skeleton: Any) -> None:
        """After the bytes are complete: the slot becomes the snapshot of ``step``."""
        self.step = step
        self.time = time.time()
        if self.directory is None:
            return
        meta = {
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "gen": uuid.uuid4().hex,
            "time": self.time,
            "nbytes": self.layout.nbytes,
            "entries": [list(e) for e in self.layout.entries],
            "skeleton": jsoncodec.dumps(skeleton),
            "source": "memory",
        }
        write_atomic(self.meta_path, json.dumps(meta))

    def close(self) -> None:
        self.views = []
        if self._mm is not None:
            if self._registered:
                addr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
                torch.cuda.cudart().cudaHostUnregister(addr)
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the OS frees it at exit
                pass
            self._mm = None


class SlotPool:
    """Two slots used alternately: one may persist to disk while the other is staged into, and
    the memory tier always keeps at least one complete snapshot."""

    def __init__(self, *, directory: Path | None, pin: bool, num_slots: int = 2) -> None:
        self.directory = directory
        self.pin = pin
        self.num_slots = num_slots
        self.slots: list[Slot] = []

    def acquire(self, layout: Layout) -> Slot | None:
        """The slot to stage into next (oldest not persisting), or None if all are persisting."""
        if not self.slots or self.slots[0].layout != layout:
            self.close()
            self.slots = [
                Slot(i, layout, directory=self.directory, pin=self.pin)
                for i in range(self.num_slots)
            ]
        free = [s for s in self.slots if not s.persisting]
        if not free:
            return None
        return min(free, key=lambda s: -1 if s.step is None else s.time)

    def close(self) -> None:
        for s in self.slots:
            s.close()
        self.slots = []


@dataclass(slots=True)
class Snapshot:
    """A complete memory-tier snapshot found on disk (tmpfs)."""

    step: int
    rank: int
    world_size: int
    gen: str
    source: str
    meta_path: Path
    bin_path: Path
    meta: dict[str, Any]

    def load(
        self, into: dict[tuple[Any, ...], torch.Tensor] | None = None
    ) -> tuple[Any, list[torch.Tensor]]:
        """(skeleton, tensors) copied out of the snapshot; raises OSError/ValueError if it
        changed while being read. ``into`` maps key paths to CPU tensors to read straight into
        (the live parameters and optimizer state: one copy, no new allocations)."""
        skeleton = decode_skeleton(self.meta.get("skeleton"), len(self.meta["entries"]))
        paths = ref_paths(skeleton) if into else {}
        layout = Layout.from_entries(self.meta["entries"], 0)
        tensors: list[torch.Tensor] = []
        reads: list[tuple[memoryview, int, int]] = []
        for i, (dtype, shape, off, n) in enumerate(layout.entries):
            dt = jsoncodec.dtype_of(dtype)
            t = (into or {}).get(paths.get(i, ()))
            if not (
                t is not None
                and t.device.type == "cpu"
                and t.dtype == dt
                and tuple(t.shape) == tuple(shape)
                and t.is_contiguous()
                and type(t) is torch.Tensor
            ):
                t = torch.empty(shape, dtype=dt)
            tensors.append(t)
            if n:
                reads.append((t.view(-1).view(torch.uint8).numpy().data.cast("B"), off, n))
        with open(self.bin_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < self.meta["nbytes"]:
                raise ValueError(f"{self.bin_path}: {size} bytes, expected {self.meta['nbytes']}")
            _parallel_pread(f.fileno(), reads)
        if not self.still_valid():
            raise ValueError(f"snapshot {self.meta_path} changed while being read")
        return skeleton, tensors

    def still_valid(self) -> bool:
        try:
            return json.loads(self.meta_path.read_text()).get("gen") == self.gen
        except (OSError, ValueError):
            return False


def bytes_digest(buf: bytes | memoryview | mmap.mmap, nbytes: int) -> str:
    """The owner's digest of a snapshot's first ``nbytes`` bytes: its 32-bit words summed into
    a 64-bit integer (a flip of bit k changes it by 2^k, never by 0 modulo 2^64) and its
    64-bit words summed, the tail bytes added; two hex numbers. What a copy held by another
    node (a replica, a peer's fill) must match to be restored from."""
    import numpy as np

    words = nbytes // 8
    arr = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
    w32 = arr[: words * 8].view(np.int32).sum(dtype=np.int64)
    w64 = arr[: words * 8].view(np.uint64).sum(dtype=np.uint64)
    tail = int(arr[words * 8 :].sum(dtype=np.int64))
    a = (int(w32) + tail) & (2**64 - 1)
    b = (int(w64) + tail) & (2**64 - 1)
    return f"{a:016x}:{b:016x}"


_DIGESTS: dict[str, str] = {}


def outgoing_meta(snap: Snapshot) -> dict[str, object]:
    """The metadata a snapshot leaves its node with (a replica pushed to a peer, a copy served
    to a peer's fill): this node's own snapshot carries its owner's digest of the bytes,
    computed here, on the memory tier's side, never on the training step's path (a copy
    that comes back differing from it is an ``sdc_suspect``). A copy of another node's
    snapshot is passed on with the digest it came with. Computed once per snapshot."""
    meta = dict(snap.meta)
    if "digest" in meta or snap.source != "memory":
        return meta
    digest = _DIGESTS.get(snap.gen)
    if digest is None:
        try:
            digest = file_digest(snap.bin_path, int(str(meta["nbytes"])))
        except (OSError, ValueError, OverflowError, KeyError):
            return meta  # not a snapshot this node can read: the receiver judges its metadata
        if len(_DIGESTS) >= 64:
            _DIGESTS.clear()
        _DIGESTS[snap.gen] = digest
    meta["digest"] = digest
    return meta


def file_digest(path: Path, nbytes: int) -> str:
    """:func:`bytes_digest` of the first ``nbytes`` bytes of the file ``path``."""
    with open(path, "rb") as f:
        if nbytes == 0:
            return bytes_digest(b"", 0)
        with mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ) as mm:
            return bytes_digest(mm, nbytes)


def _parallel_pread(fd: int, reads: list[tuple[memoryview, int, int]]) -> None:
    """Read ``(destination, offset, nbytes)`` chunks, several at once (preadv drops the GIL)."""
    chunk = 64 << 20
    jobs = [
        (dst[o : o + chunk], off + o, min(chunk, n - o))
        for dst, off, n in reads
        for o in range(0, n, chunk)
    ]

    def one(job: tuple[memoryview, int, int]) -> None:
        dst, off, n = job
        got = 0
        while got < n:
            k = os.preadv(fd, [dst[got:n]], off + got)
            if k <= 0:
                raise ValueError(f"short read at offset {off + got}")
            got += k

    threads = min(len(jobs), os.cpu_count() or 1, 8)
    if threads <= 1:
        for job in jobs:
            one(job)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, jobs))


def list_snapshots(rank_dir: Path) -> list[Snapshot]:
    """Complete snapshots of one rank, newest step first."""
    out = []
    try:
        names = os.listdir(rank_dir)
    except FileNotFoundError:
        return []
    for name in names:
        if not (name.startswith("slot") and name.endswith(".json")):
            continue
        meta_path = rank_dir / name
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        out.append(
            Snapshot(
                step=int(meta["step"]),
                rank=int(meta["rank"]),
                world_size=int(meta["world_size"]),
                gen=str(meta["gen"]),
                source=str(meta.get("source", "memory")),
                meta_path=meta_path,
                bin_path=meta_path.with_suffix(".bin"),
                meta=meta,
            )
        )
    out.sort(key=lambda s: -s.step)
    return out


def rank_dir(memory_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(memory_dir) / f"rank_{rank}"


def dtensor_infos(tensors: list[torch.Tensor]) -> list[_DTensorInfo | None]:
    return [_dtensor_info(t) for t in tensors]


def as_dtensors(views: list[torch.Tensor], infos: list[_DTensorInfo | None]) -> list[torch.Tensor]:
    """Wrap staged local shards back into DTensors so DCP sees the global layout."""
    if not any(infos):
        return views
    from torch.distributed.tensor import DTensor

    out = []
    for v, info in zip(views, infos, strict=True):
        if info is None:
            out.append(v)
        else:
            out.append(
                DTensor.from_local(
                    v,
                    info.mesh,
                    info.placements,
                    run_check=False,
                    shape=torch.Size(info.shape),
                    stride=info.stride,
                )
            )
    return out
