"""Checkpoint stall, commit and restore times: trainguard vs torch.save vs DCP (sync/async).

Every stall is measured the same way, inside a real training loop (forward, backward, Adam
step): the wall time of the step that ends with the save call plus the following step (which
includes any wait for staging before its optimizer step), minus the same two steps without a
save, measured right before. Medians over ``--trials`` saves. Before every trial of every path
the dirty pages of the last one are written back (``sync``). Commit times (save → durable
commit, nothing else running) are measured with the default mode's trials alternating with
``dcp.save``'s (``dcp_save_s``; ``dcp_save_stall_s`` is its stall in the training loop).
Prints one JSON line.

    python bench/checkpoint.py                                  # CPU, float32, ~1.2 GiB state
    python bench/checkpoint.py --device cuda --dtype bfloat16 --size-gib 8   # H200, ~3 min

On CUDA the baselines are a raw device→pinned-host copy of the same bytes and DCP async_save
with pinned, async staging; the disk-bound CPU baselines (torch.save, DCP sync save) are skipped
unless ``--all``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = args.device
        self.dtype = getattr(torch, args.dtype)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        dim = args.dim
        # Adam: parameters + exp_avg + exp_avg_sq, all in the parameters' dtype
        layers = max(1, math.ceil(args.size_gib * 2**30 / (3 * elem * dim * dim)))
        torch.manual_seed(0)
        self.model = nn.Sequential(
            *[
                nn.Linear(dim, dim, bias=False, device=self.device, dtype=self.dtype)
                for _ in range(layers)
            ]
        )
        # fused Adam: one pass over the state per step (keeps the step, and its noise, short)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4, fused=True)
        self.x = torch.randn(args.batch, dim, device=self.device, dtype=self.dtype)
        self.before_opt: Callable[[], None] | None = None
        self.step()  # creates the optimizer state
        self.state_bytes = sum(t.numel() * t.element_size() for t in self._tensors())
        self.root = Path(args.root or tempfile.mkdtemp(prefix="tg-bench-ckpt-"))
        self.root.mkdir(parents=True, exist_ok=True)

    def _tensors(self) -> list[torch.Tensor]:
        out = [p.data for p in self.model.parameters()]
        for s in self.opt.state.values():
            out += [v for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def step(self) -> float:
        t0 = time.perf_counter()
        loss = self.model(self.x).float().pow(2).mean()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        if self.before_opt is not None:
            self.before_opt()
            self.before_opt = None
        self.opt.step()
        _sync(self.device)
        return time.perf_counter() - t0

    def base_two_steps(self) -> float:
        pairs = 3 if self.device == "cuda" else 1
        return statistics.median(self.step() + self.step() for _ in range(pairs))

    def measure(
        self,
        save: Callable[[int], Any],
        finish: Callable[[Any], None] | None = None,
        *,
        trials: int,
        slowdown: list[float] | None = None,
        done: Callable[[Any], bool] | None = None,
        cleanup: bool = True,
    ) -> tuple[list[float], list[float]]:
        """(stalls, commit times) over ``trials`` saves."""
        stalls, commits = [], []
        self.bases: list[float] = []
        for i in range(trials):
            _settle()  # the last trial's writes are on disk: none of it is charged to this one
            base = self.base_two_steps()
            t0 = time.perf_counter()
            self.step()
            ts = time.perf_counter()
            handle = save(i)
            self.step()
            window = time.perf_counter() - t0
            if slowdown is not None and done is not None:
                while not done(handle):
                    slowdown.append(self.step())
            if finish is not None:
                finish(handle)
            commits.append(time.perf_counter() - ts)
            if self.device == "cpu":  # noisy shared box: baseline before and after the save
                base = (base + self.base_two_steps()) / 2
            stalls.append(window - base)
            self.bases.append(base / 2)
            if cleanup:  # an 8 GiB state x trials would fill a small disk
                self.clean()
        return stalls, commits

    def clean(self) -> None:
        for p in self.root.iterdir():
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()


def _settle() -> None:
    """Write back every dirty page (the previous trial's checkpoint): a trial that follows a
    large write would otherwise pay for the write-back of it, whichever path it measures."""
    os.sync()


def _phase(name: str, t0: list[float]) -> None:
    print(
        f"[bench] {name} done at {time.perf_counter() - t0[0]:.1f} s", file=sys.stderr, flush=True
    )


def _drop_page_cache(root: Path) -> None:
    """Evict a checkpoint's (clean, fsynced) pages from the page cache; no root needed."""
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _shm_free() -> int:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return 0


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    clock = [time.perf_counter()]
    dist.init_process_group("gloo" if args.device == "cpu" else "cpu:gloo,cuda:nccl")
    b = Bench(args)
    T = args.trials
    out: dict[str, Any] = {
        "bench": "checkpoint",
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "state_bytes": b.state_bytes,
        "state_gib": round(b.state_bytes / 2**30, 3),
        "trials": T,
        "torch": torch.__version__,
    }
    base_steps = [b.step() for _ in range(5)]
    out["base_step_s"] = _median(base_steps)
    cpu_baselines = args.device == "cpu" or args.all

    # -- floor: copy into preallocated host buffers ---------------------------------------------
    pin = args.device == "cuda"
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in b._tensors()]

    def copy_floor(_: int) -> None:
        for src, dst in zip(b._tensors(), bufs, strict=True):
            dst.copy_(src, non_blocking=pin)
        _sync(args.device)

    stalls, _ = b.measure(copy_floor, trials=T)
    out["copy_floor_s"] = _median(stalls)
    raw = []
    for _ in range(T):
        t0 = time.perf_counter()
        copy_floor(0)
        raw.append(time.perf_counter() - t0)
    out["raw_copy_s"] = _median(raw)
    bufs = []

    # -- torch.save (+ fsync) and DCP synchronous save -----------------------------------------
    if cpu_baselines:

        def torch_save(i: int) -> None:
            path = b.root / f"torch_{i}.pt"
            with open(path, "wb") as f:
                torch.save(b.state_dict(), f)
                f.flush()
                os.fsync(f.fileno())

        stalls, _ = b.measure(torch_save, trials=T)
        out["torch_save_s"] = _median(stalls)
        b.clean()

        def dcp_save(i: int) -> None:
            dcp.save(b.state_dict(), checkpoint_id=str(b.root / f"dcp_{i}"))

        stalls, _ = b.measure(dcp_save, trials=T)
        out["dcp_save_stall_s"] = _median(stalls)  # dcp_save_s: beside trainguard's commit
        b.clean()

    # -- DCP async_save: thread, process, process + async staging ------------------------------
    _phase("sync baselines", clock)
    if cpu_baselines:
        _dcp_async_default(b, out, T)
        _phase("dcp async default", clock)
    _dcp_best(b, out, T)
    _phase("dcp best", clock)
    _trainguard(b, out, T)
    _phase("trainguard", clock)

    def ratio(a: str, c: str) -> float | None:
        x, y = out.get(a), out.get(c)
        return round(x / y, 3) if x is not None and y else None

    out["ratio_stall_vs_dcp_process"] = ratio("trainguard_stall_s", "dcp_async_process_stall_s")
    out["ratio_stall_vs_dcp_best"] = ratio("trainguard_stall_s", "dcp_best_stall_s")
    out["ratio_stall_vs_raw_copy"] = ratio("trainguard_stall_s", "raw_copy_s")
    out["ratio_commit_vs_dcp_save"] = ratio("trainguard_commit_s", "dcp_save_s")
    out["ratio_commit_best_vs_dcp_save_best"] = ratio("trainguard_commit_best_s", "dcp_save_best_s")
    out["restore_speedup_memory_vs_disk"] = ratio("restore_disk_s", "restore_memory_s")
    out["ratio_memory_snapshot_vs_raw_copy"] = ratio("memory_snapshot_stall_s", "raw_copy_s")
    for mode in ("thread", "process"):
        out[f"ratio_stall_{mode}_vs_raw_copy"] = ratio(f"trainguard_{mode}_stall_s", "raw_copy_s")
    if not args.root:
        shutil.rmtree(b.root, ignore_errors=True)
    dist.destroy_process_group()
    return out


def _dcp_async_default(b: Bench, out: dict[str, Any], T: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    def async_thread(i: int) -> Any:
        return dcp.async_save(b.state_dict(), checkpoint_id=str(b.root / f"at_{i}"))

    stalls, commits = b.measure(async_thread, lambda f: f.result(), trials=T)
    out["dcp_async_thread_stall_s"] = _median(stalls)
    out["dcp_async_thread_commit_while_training_s"] = _median(commits)
    b.clean()

    def async_process(i: int) -> Any:
        return dcp.async_save(
            b.state_dict(),
            checkpoint_id=str(b.root / f"ap_{i}"),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )

    async_process(999).result()  # the first call starts the background process
    b.clean()
    stalls, commits = b.measure(async_process, lambda f: f.result(), trials=T)
    out["dcp_async_process_stall_s"] = _median(stalls)
    out["dcp_async_process_commit_while_training_s"] = _median(commits)
    b.clean()


def _dcp_best(b: Bench, out: dict[str, Any], T: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    cuda = b.device == "cuda"
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=_shm_free() > 1.2 * b.state_bytes,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
    )

    def best(i: int) -> Any:
        resp = dcp.async_save(
            b.state_dict(),
            checkpoint_id=str(b.root / f"ab_{i}"),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        # the optimizer must not change the state before staging completed
        b.before_opt = lambda: resp.staging_completion.result()
        return resp

    best(998).upload_completion.result()
    b.clean()
    stalls, commits = b.measure(best, lambda r: r.upload_completion.result(), trials=T)
    out["dcp_best_stall_s"] = _median(stalls)
    out["dcp_best_commit_while_training_s"] = _median(commits)
    stager.close()
    b.clean()


def _trainguard(b: Bench, out: dict[str, Any], T: int) -> None:
    from trainguard.checkpoint.manager import CheckpointManager
    from trainguard.core.config.checkpoint import CheckpointConfig

    shm_root = "/dev/shm" if _shm_free() > 3.3 * b.state_bytes else None  # 3 slots
    out["memory_tier_dir"] = shm_root or tempfile.gettempdir()
    mem = Path(tempfile.mkdtemp(prefix="tg-bench-mem-", dir=shm_root))
    # DCP's thread_count knob; on a GPU host there are cores to spare
    io_threads = 4 if b.device == "cuda" else None  # None: the automatic value
    state = {"model": b.model, "optim": b.opt}
    default = CheckpointConfig().persist_mode
    for k, mode in enumerate(("thread", "process", default)):
        s0 = 10_000 * (k + 1)  # each mode its own steps: none overwrites another's checkpoint
        cfg = CheckpointConfig(
            dir=str(b.root / "tg"), keep_last=1, io_threads=io_threads, persist_mode=mode
        )
        mgr = CheckpointManager(config=cfg, memory_dir=mem, install_signal_handlers=False)
        out[f"trainguard_{mode}_resolved"] = _warm_up(mgr, state, s0)
        slow: list[float] = []
        stalls, commits = b.measure(
            lambda i: mgr.save(s0 + 1000 + i, state),  # noqa: B023 (called within this iteration)
            lambda r: r.wait(),
            trials=T,
            slowdown=slow,
            done=lambda r: r.done.is_set(),
            cleanup=False,  # its own retention keeps the newest
        )
        out[f"trainguard_{mode}_stall_s"] = _median(stalls)
        out[f"trainguard_{mode}_commit_while_training_s"] = _median(commits)
        out[f"trainguard_{mode}_commit_s"] = _median(commits)
        if b.device == "cpu":
            # On a small CPU box the background persist competes with the training loop for
            # the cores, so also time the save → durable-commit pipeline alone; the default
            # mode's trials alternate (in a random order per pair) with dcp.save's, each after
            # the same settling, so both meet the disk in the same state (dcp_save_s).
            out[f"trainguard_{mode}_commit_s"] = _idle_commits(
                b,
                out,
                T,
                lambda i: mgr.save(s0 + 1100 + i, state).wait(),  # noqa: B023 (called here)
                with_dcp=mode == default,
            )
        # steps while a persist runs vs the steps without a save measured around them
        out[f"persist_step_slowdown_{mode}"] = (
            round(statistics.median(slow) / statistics.median(b.bases), 3) if slow else None
        )
        out[f"persist_steps_observed_{mode}"] = len(slow)
        if mode == default:
            # the memory tier's snapshot (persist=False), what its cadence charges per snapshot
            stalls, _ = b.measure(
                lambda i: mgr.save(s0 + 1200 + i, state, persist=False),  # noqa: B023
                lambda r: r.wait_staged(),
                trials=T,
                cleanup=False,
            )
            out["memory_snapshot_stall_s"] = _median(stalls)
        mgr.close()
    # the headline figures are those of the default mode
    out["persist_mode"] = default
    out["trainguard_stall_s"] = out[f"trainguard_{default}_stall_s"]
    out["trainguard_commit_s"] = out[f"trainguard_{default}_commit_s"]
    out["persist_step_slowdown"] = out[f"persist_step_slowdown_{default}"]
    cfg = CheckpointConfig(dir=str(b.root / "tg"), keep_last=1, io_threads=io_threads)

    # -- restore: memory tier vs disk ---------------------------------------------------------
    sources: list[str] = []

    def on_event(kind: str, **f: Any) -> None:
        if kind == "checkpoint_restored":
            sources.append(str(f.get("source")))

    mgr = CheckpointManager(
        config=cfg, memory_dir=mem, events=on_event, install_signal_handlers=False
    )
    rm, rd, rw = [], [], []
    cuda = b.device == "cuda"
    for _ in range(2 if cuda else T):  # (GPU: the 3-minute budget)
        t0 = time.perf_counter()
        assert mgr.restore(state) is not None
        _sync(b.device)
        rm.append(time.perf_counter() - t0)
        # disk as after a node restart: the checkpoint's pages are not in the page cache
        _drop_page_cache(b.root / "tg")
        t0 = time.perf_counter()
        assert mgr.restore(state, use_memory=False) is not None
        _sync(b.device)
        rd.append(time.perf_counter() - t0)
        if not cuda:
            t0 = time.perf_counter()
            assert mgr.restore(state, use_memory=False) is not None
            rw.append(time.perf_counter() - t0)
    mgr.close()
    out["restore_sources"] = sorted(set(sources))  # must be ["disk", "memory"]
    out["restore_memory_s"] = _median(rm)
    out["restore_disk_s"] = _median(rd)
    out["restore_disk_page_cached_s"] = _median(rw)
    shutil.rmtree(mem, ignore_errors=True)
    b.clean()


def _idle_commits(
    b: Bench, out: dict[str, Any], T: int, commit: Callable[[int], bool], *, with_dcp: bool
) -> float:
    """The median time of ``commit`` (save → durable commit, no training beside it) over
    ``T`` trials; ``with_dcp``: each beside a ``dcp.save`` of the same state, in a random
    order per pair, and ``dcp_save_s`` set to their median."""
    import random

    import torch.distributed.checkpoint as dcp

    rng = random.Random(0)
    ours: list[float] = []
    theirs: list[float] = []
    for i in range(T):
        order = ["ours", "dcp"] if with_dcp else ["ours"]
        rng.shuffle(order)
        for who in order:
            for p in b.root.glob("dcp_idle_*"):
                shutil.rmtree(p, ignore_errors=True)
            time.sleep(1.0)  # the persister's retention of the last commit is done
            _settle()
            t0 = time.perf_counter()
            if who == "ours":
                assert commit(i)
                ours.append(time.perf_counter() - t0)
            else:
                dcp.save(b.state_dict(), checkpoint_id=str(b.root / f"dcp_idle_{i}"))
                theirs.append(time.perf_counter() - t0)
    for p in b.root.glob("dcp_idle_*"):
        shutil.rmtree(p, ignore_errors=True)
    if with_dcp:  # this disk's fsync is bimodal (a save takes x or about 3x): every trial kept
        out["dcp_save_s"] = _median(theirs)
        out["dcp_save_best_s"] = round(min(theirs), 4)
        out["dcp_save_trials_s"] = [round(x, 3) for x in theirs]
        out["trainguard_commit_best_s"] = round(min(ours), 4)
        out["trainguard_commit_trials_s"] = [round(x, 3) for x in ours]
    return _median(ours)


def _warm_up(mgr: Any, state: dict[str, Any], s0: int) -> str:
    """Allocate the slots and, where the mode starts a persister process, wait until saves
    go through it (a job's first saves persist in the thread while it starts). Returns where
    the saves persist: "thread" or "process"."""
    mgr.save(s0, state, persist=False).wait_staged()  # the state's size, for "auto"
    deadline = time.monotonic() + 300
    for step in range(1000):
        r = mgr.save(s0 + step, state)
        r.wait()
        if r.via_process or mgr._supervisor.proc is None or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return "process" if r.via_process else "thread"


def _headline(out: dict[str, Any]) -> str:
    """The default mode's figures, then every mode's, side by side."""

    def f(key: str) -> str:
        v = out.get(key)
        return "-" if v is None else f"{v:.4f}"

    mode = out["persist_mode"]
    lines = [
        f"default persist_mode={mode} (persists in: {out.get(f'trainguard_{mode}_resolved')}): "
        f"stall {f('trainguard_stall_s')} s = {out.get('ratio_stall_vs_raw_copy')} x raw copy "
        f"({f('raw_copy_s')} s), {out.get('ratio_stall_vs_dcp_best')} x DCP best "
        f"({f('dcp_best_stall_s')} s); commit {f('trainguard_commit_s')} s = "
        f"{out.get('ratio_commit_vs_dcp_save')} x dcp.save (best trials: "
        f"{out.get('ratio_commit_best_vs_dcp_save_best')} x); memory snapshot stall "
        f"{f('memory_snapshot_stall_s')} s = {out.get('ratio_memory_snapshot_vs_raw_copy')} x "
        f"raw copy; restore memory {f('restore_memory_s')} s vs disk {f('restore_disk_s')} s",
        f"{'path':<34}{'stall s':>10}{'commit s':>10}",
    ]
    rows = [
        (f"trainguard {m}", f"trainguard_{m}_stall_s", f"trainguard_{m}_commit_s")
        for m in dict.fromkeys(("thread", "process", mode))
    ]
    rows += [
        (
            "DCP async (thread)",
            "dcp_async_thread_stall_s",
            "dcp_async_thread_commit_while_training_s",
        ),
        (
            "DCP async (process)",
            "dcp_async_process_stall_s",
            "dcp_async_process_commit_while_training_s",
        ),
        ("DCP best (shm staging, process)", "dcp_best_stall_s", "dcp_best_commit_while_training_s"),
        ("DCP sync save", "dcp_save_stall_s", "dcp_save_s"),
        ("torch.save", "torch_save_s", "torch_save_s"),
        ("raw copy", "raw_copy_s", "raw_copy_s"),
    ]
    lines += [f"{name:<34}{f(a):>10}{f(c):>10}" for name, a, c in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="float32 (cpu default) or bfloat16 (cuda default)")
    p.add_argument("--size-gib", type=float, default=None, help="state size (default 1.1 / 8)")
    p.add_argument("--dim", type=int, default=None, help="width of the square layers")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--root", default=None, help="checkpoint directory (default: a temp dir)")
    p.add_argument("--all", action="store_true", help="also the disk-bound baselines on CUDA")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.size_gib = args.size_gib or (8.0 if cuda else 1.1)
    args.dim = args.dim or (8192 if cuda else 4096)
    args.batch = args.batch or (4096 if cuda else 8)
    if not cuda:
        torch.set_num_threads(args.threads)
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    out = run(args)
    print(_headline(out), flush=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
