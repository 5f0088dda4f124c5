"""The weight-version side of the vLLM adapter: which version vLLM holds, and a verified refit.

A refit of version ``v`` copies the store's file into a Hugging Face checkpoint directory, checks
the copy (the SHA-256 the trainer wrote for ``v``, a whole safetensors file, every tensor of the
model at its shape) and only then loads it by vLLM's own APIs: ``/pause?mode=keep``,
``/collective_rpc`` ``reload_weights``, ``/update_weight_version``, ``/resume``, then one
generation on ``v``. A failed load restores the previous version; when that fails too the
replica holds no whole version (``fatal``) and is restarted. A client's refit check quarantines
the engine (no completions, health ``quarantined``) until it verified a version.

:class:`RefitGate` is what a generation and a refit agree on: a refit closes it (new
generations wait) and starts a new epoch (what was in flight is generated again after, on the
new version).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.rl.engines._vllm_http import AdapterError
from trainguard.rl.engines._vllm_server import (
    MODEL_FILE,
    VllmServer,
    WeightFileError,
    bad_shape_dir,
    check_safetensors,
    compare_shapes,
    hf_version_dir,
)
from trainguard.rl.weights import WeightStore

__all__ = ["RefitGate", "VerifiedRefit"]

logger = logging.getLogger(__name__)


class RefitGate:
    """The weight version vLLM holds, and the gate between generations and refits."""

    def __init__(self) -> None:
        self.version: int | None = None
        """None while a refit replaces the weights (and before the first version)."""
        self.inflight = 0
        self.requeued = 0
        """Generations that a refit ran under, generated again on the new version."""
        self._cv = threading.Condition()
        self._closed = False
        self._epoch = 0

    def enter(self) -> tuple[int, int | None]:
        """A generation starts (after a refit that runs): its ``(epoch, version)``."""
        with self._cv:
            while self._closed:
                self._cv.wait()
            self.inflight += 1
            return self._epoch, self.version

    def leave(self) -> None:
        with self._cv:
            self.inflight -= 1

    def held(self, epoch: int, version: int | None) -> bool:
        """Whether ``version`` generated all of a generation that entered at ``epoch`` (no
        refit ran under it); False counts it as re-queued."""
        with self._cv:
            if epoch == self._epoch and version is not None:
                return True
            self.requeued += 1
            return False

    @contextmanager
    def closed(self) -> Iterator[None]:
        """New generations wait until the block ends."""
        with self._cv:
            self._closed = True
        try:
            yield
        finally:
            with self._cv:
                self._closed = False
                self._cv.notify_all()

    def next_epoch(self) -> None:
        """Whatever is in flight is generated again (on the version loaded next)."""
        with self._cv:
            self._epoch += 1


class _Replica(Protocol):
    """What a refit uses of the adapter."""

    status: S
    server: VllmServer | None

    def who(self, version: int | None = None) -> str: ...
    def generate_probe(self) -> None: ...
    def take_fault(self, *kinds: str) -> str | None: ...


class VerifiedRefit:
    """Loads versions of ``store`` into vLLM, checked before and after; counts what failed."""

    def __init__(
        self,
        replica: _Replica,
        gate: RefitGate,
        store: WeightStore,
        work: Path,
        shapes: dict[str, tuple[int, ...]],
    ) -> None:
        self.replica = replica
        self.gate = gate
        self.store = store
        self.work = work
        self.shapes = shapes
        """The model's tensors: a version must hold each at this shape."""
        self.refits = 0
        self.refits_failed = 0
        self.quarantines = 0
        self.last_error: str | None = None
        self.fatal: str | None = None
        """Set when vLLM holds no whole version and cannot be given one: the adapter exits."""
        self._lock = threading.Lock()
        self._refused: tuple[int, int, int] | None = None
        """(version, size, mtime) of the last file refused: not checked again until it changes."""
        self._dirs: dict[int, Path] = {}

    @contextmanager
    def idle(self) -> Iterator[None]:
        """No refit runs in the block (one that failed has answered its request)."""
        with self._lock:
            yield

    def refit(self, version: int) -> float:
        """Load ``version`` into vLLM; the seconds it took. AdapterError (404: not in the
        store; 422: not a whole file; 500: vLLM failed) with one line naming what to fix."""
        r = self.replica
        with self._lock:
            t0 = time.perf_counter()
            if version == self.gate.version and r.status == S.SERVING:
                return 0.0  # already loaded (the store watcher was first)
            if self.fatal is not None:
                raise AdapterError(503, self.fatal)
            src = self.store.path_of(version)
            if not src.is_file():
                raise AdapterError(
                    404,
                    f"{r.who()}: weight version {version} is not in {self.store.root} "
                    f"(the store keeps the newest {self.store.keep}); publish it, or refit to "
                    "a version the store holds",
                )
            st = src.stat()
            key = (version, st.st_size, st.st_mtime_ns)
            if key == self._refused and self.last_error is not None:
                raise AdapterError(422, self.last_error)  # the same file: refused once, no retry
            d = hf_version_dir(self.work, version, src)  # the copy checked is the copy loaded
            try:
                why = self._digest_differs(version, d / MODEL_FILE) or compare_shapes(
                    check_safetensors(d / MODEL_FILE), self.shapes
                )
            except WeightFileError as e:
                why = str(e).replace(str(d / MODEL_FILE), str(src))
            if why is not None:
                shutil.rmtree(d, ignore_errors=True)
                self._refused = key
                self._failed(
                    f"{r.who()}: weight version {version} refused: {why}; republish it whole"
                )
                raise AdapterError(422, str(self.last_error))
            if r.take_fault("refit_500"):
                d = bad_shape_dir(self.work, version, src)
            prev = self.gate.version
            try:
                self._load(d, version)
                r.generate_probe()
            except AdapterError as e:
                msg = f"{r.who(version)}: vLLM could not load it ({e.message})"
                if not self._restore(prev):
                    r.status = S.LOADING
                    msg += "; it holds no whole version: the replica restarts"
                    self.fatal = msg
                else:
                    msg += f"; it serves version {prev} again: republish or refit again"
                self._failed(msg)
                raise AdapterError(500, msg) from None
            self._dirs[version] = d
            self._prune()
            self.refits += 1
            if r.status not in (S.STANDBY, S.QUARANTINED):  # quarantined: until verified
                r.status = S.SERVING
            return time.perf_counter() - t0

    def quarantine(self, version: int | None, reason: str) -> None:
        """A client found this engine's weights not to be ``version``: answer no completion
        but a refit check (503, health ``quarantined``) until a client verified a version."""
        r = self.replica
        if r.status in (S.SERVING, S.QUARANTINED):
            r.status = S.QUARANTINED
        self.quarantines += 1
        logger.warning("vllm: %s quarantined: %s", r.who(version), reason)

    def verified(self, version: int) -> bool:
        """A client verified ``version``: serve again (False: this engine holds another)."""
        r = self.replica
        if self.gate.version != version:
            return False
        if r.status == S.QUARANTINED:
            r.status = S.SERVING
            logger.info("vllm: %s verified; serving again", r.who(version))
        return True

    def _digest_differs(self, version: int, copy: Path) -> str | None:
        """What is wrong when the copy vLLM would load is not the bytes the trainer wrote for
        ``version`` (the SHA-256 in the store's metadata); None when they are, or when the
        metadata has no digest."""
        try:
            want = self.store.meta(version).get("sha256")
        except (OSError, ValueError):
            return None
        if not isinstance(want, str):
            return None
        h = hashlib.sha256()
        with open(copy, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        got = h.hexdigest()
        if got == want:
            return None
        return (
            f"its SHA-256 is {got[:12]}…, not the {want[:12]}… the trainer wrote (truncated or "
            "changed after it was published)"
        )

    def _load(self, d: Path, version: int) -> None:
        """pause(keep) → reload_weights → update_weight_version → resume, the gate closed:
        new requests wait, the ones in flight are frozen by vLLM and generated again after."""
        with self.gate.closed():
            self._admin("POST", "/pause?mode=keep", None)
            try:
                self.gate.next_epoch()  # whatever was in flight is re-run on the new version
                self.gate.version = None
                self._admin("POST", "/collective_rpc",
                            {"method": "reload_weights", "kwargs": {"weights_path": str(d)}})  # fmt: skip
                self._admin("POST", "/update_weight_version", {"new_version": str(version)})
                self.gate.version = version
            finally:
                self._admin("POST", "/resume", None)

    def _restore(self, prev: int | None) -> bool:
        d = self._dirs.get(prev) if prev is not None else None
        if d is None or prev is None:
            return False
        try:
            self._load(d, prev)
            self.replica.generate_probe()
            return True
        except AdapterError as e:
            logger.error("%s: restoring version %s failed: %s", self.replica.who(), prev, e.message)
            return False

    def _admin(self, method: str, path: str, body: object) -> None:
        server = self.replica.server
        assert server is not None
        try:
            code, ans = server.request(method, path, body, timeout=120)
        except OSError as e:
            raise AdapterError(503, f"{method} {path}: no answer from vLLM ({e})") from None
        if code != 200:
            raise AdapterError(502, f"{method} {path}: vLLM answered {code}: {str(ans)[:200]}")

    def _failed(self, msg: str) -> None:
        self.refits_failed += 1
        self.last_error = msg
        logger.error("%s", msg)

    def _prune(self) -> None:
        keep = {self.gate.version}
        for v in [v for v in self._dirs if v not in keep]:
            shutil.rmtree(self._dirs.pop(v), ignore_errors=True)
