"""trainguard.checkpoint across processes under ``trainguard run`` (gloo, CPU): exact resume of
examples/train_mlp.py after a kill -9 from disk (from the memory tier: test_run_restarts),
resharding 2 → 1 and 2 → 3 ranks, and the preemption signals (to the agent, then to the requeued job's workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, steps_done
from tests.mlp_reference import assert_same_as_reference
from tests.procs import kill_tree
from trainguard.core.failures import REQUEUE_EXIT_CODE

EXAMPLE = str(REPO / "examples" / "train_mlp.py")


def _run(args: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 240):
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "trainguard", "run", *args],
        cwd=cwd,
        env=env or base_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x]


def _train(tmp: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> Path:
    d = tmp / name
    r = _run(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--tg-run-dir",
            str(d / "run"),
            EXAMPLE,
            "--steps",
            "100",
            "--out",
            str(d / "params.pt"),
            "--out-optim",
            str(d / "optim.pt"),
            *extra,
        ],
        cwd=d,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return d


@pytest.mark.slow
def test_kill_9_resume_is_bitwise_identical_from_disk(tmp_path: Path) -> None:
    # From disk: persist_mode=process, memory tier off; rank 1's persister process is
    # SIGKILLed while writing step 20, and rank 1 itself at step 75, so the restart reads the
    # disk. (Thread persist mode, the default, writes the same DCP checkpoint: its exact
    # round trip is test_checkpoint_core's, its restore after a kill in a real job test_chaos's.
    # The restore from the memory tier after a kill -9, exact to the bit, is
    # test_run_restarts.test_kill9_restart_twice's.)
    process = base_env(
        TRAINGUARD_CHECKPOINT_MEMORY_TIER="0",
        TRAINGUARD_CHECKPOINT_PERSIST_MODE="process",
        TRAINGUARD_TEST_CHECKPOINT_FAULT=json.dumps(
            {"kill_at": "written", "step": 20, "rank": 1, "attempt": 0}
        ),
    )
    proc_d = _train(tmp_path, "process", "--fail-at-step", "75", env=process)

    # a fault-free run's parameters and Adam state (tests/mlp_reference.py)
    assert_same_as_reference(proc_d / "params.pt", 100, optim=proc_d / "optim.pt")

    ev = _events(proc_d / "run")
    first = [e for e in ev if e["attempt"] == 0]
    failed = [e["step"] for e in first if e["kind"] == "checkpoint_failed" and e["rank"] == 1]
    assert failed[:1] == [20], failed
    errors = [e["error"] for e in first if e["kind"] == "checkpoint_failed" and e["step"] == 20]
    assert any("died (exit code -9)" in x for x in errors), errors
    assert any(e["kind"] == "checkpoint_persister_replaced" for e in first)
    assert 20 not in {e["step"] for e in first if e["kind"] == "checkpoint_committed"}
    committed = [e for e in ev if e["kind"] == "checkpoint_committed"]
    assert committed and all(e["persist_mode"] == "process" for e in committed)

    restored = [e for e in ev if e["kind"] == "checkpoint_restored" and e["step"]]
    # disk checkpoints every 20 steps; step 60's may still be persisting when step 75 dies,
    # in which case it never committed and the restore falls back to step 40
    assert {e["source"] for e in restored} == {"disk"}
    assert len({e["step"] for e in restored}) == 1 and restored[0]["step"] in (40, 60), restored
    assert any(e["kind"] == "worker_failed" and e["signal"] == "SIGKILL" for e in ev)


RESHARD_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import trainguard

    mode, out = sys.argv[1], sys.argv[2]
    tg = trainguard.init()
    dist.init_process_group("gloo")
    ws = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(48 * 4, dtype=torch.float32).reshape(48, 4)
    table = distribute_tensor(full.clone() if mode == "save" else torch.zeros_like(full), mesh, [Shard(0)])
    extra = {"table": table, "epoch": 0}
    state = {"model": model, "optim": opt, "extra": extra}
    ckpt = tg.checkpoint
    if mode == "save":
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        extra["epoch"] = 7
        assert ckpt.save(3, state).wait()
        if tg.rank == 0:
            torch.save({"params": [p.detach().clone() for p in model.parameters()],
                        "optim": opt.state_dict()}, out)
    else:
        step = ckpt.restore(state)
        want = torch.load(out)
        assert step == 3, step
        assert extra["epoch"] == 7
        assert torch.equal(extra["table"].full_tensor(), full)
        assert extra["table"].to_local().shape[0] == 48 // ws
        for p, q in zip(model.parameters(), want["params"]):
            assert torch.equal(p.detach(), q)
        got = opt.state_dict()
        for i in want["optim"]["state"]:
            for k, v in want["optim"]["state"][i].items():
                assert torch.equal(got["state"][i][k], v), (i, k)
        print(f"RESHARD_OK rank {tg.rank}/{ws}")
    ckpt.close()
    dist.destroy_process_group()
    tg.close()
    """
)


@pytest.mark.slow
def test_reshard_2_to_1_and_2_to_3(tmp_path: Path) -> None:
    # 2 → 3: rank 1 of three holds rows 16..31, across the two saved shards (0..23, 24..47),
    # and three ranks read two ranks' files
    script = tmp_path / "reshard.py"
    script.write_text(RESHARD_SCRIPT)
    ckpt = tmp_path / "ckpt"
    env = base_env(TRAINGUARD_CHECKPOINT_DIR=str(ckpt))
    out = str(tmp_path / "saved.pt")

    def launch(n: int, mode: str, name: str):
        return _run(
            [
                "--standalone",
                "--nproc-per-node",
                str(n),
                "--tg-run-dir",
                str(tmp_path / name),
                str(script),
                mode,
                out,
            ],
            cwd=tmp_path / name,
            env=env,
        )

    r = launch(2, "save", "save2")
    assert r.returncode == 0, r.stderr[-4000:]
    with ThreadPoolExecutor(2) as ex:
        r1, r3 = ex.map(lambda a: launch(*a), [(1, "load", "load1"), (3, "load", "load3")])
    assert r1.returncode == 0, r1.stderr[-4000:]
    assert r3.returncode == 0, r3.stderr[-4000:]
    assert r1.stdout.count("RESHARD_OK") == 1
    assert r3.stdout.count("RESHARD_OK") == 3
    for name in ("load1", "load3"):
        restored = [e for e in _events(tmp_path / name) if e["kind"] == "checkpoint_restored"]
        assert restored and all(e["source"] == "disk" and e["step"] == 3 for e in restored)


def _start_long_job(
    tmp_path: Path, env: dict[str, str], run: str, *extra: str, past: int = 15
) -> subprocess.Popen:
    """A job of 2 ranks that trains until stopped; returned once it recorded step ``past``."""
    args = [
        sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
        *extra, "--tg-run-dir", str(tmp_path / run),
        EXAMPLE, "--steps", "100000", "--step-sleep", "0.05", "--ckpt-every", "100000",
    ]  # fmt: skip
    p = subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while steps_done(tmp_path / run) < past:
        if time.monotonic() > deadline or p.poll() is not None:
            kill_tree(p)
            raise AssertionError(p.communicate(timeout=30)[1][-3000:])
        time.sleep(0.2)
    return p


def _requeued(p: subprocess.Popen) -> tuple[str, str]:
    """The job's stdout and stderr once it exited with the requeue code; one that does not end
    is killed (its workers with it) and its stderr shown."""
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_tree(p)
        raise AssertionError(f"no exit: {p.communicate(timeout=30)[1][-3000:]}") from None
    assert p.returncode == REQUEUE_EXIT_CODE, err[-3000:]
    return out, err


def _preempt_saved_step(run_dir: Path, ckpt: Path) -> int:
    events = _events(run_dir)
    pre = [e for e in events if e["kind"] == "checkpoint_preempted"]
    saved = [e for e in events if e["kind"] == "checkpoint_preempt_saved"]
    assert pre and saved and saved[0]["committed"] is True, events[-5:]
    step = saved[0]["step"]
    assert step >= 15
    assert (ckpt / f"step_{step:08d}" / "manifest.json").exists()
    assert [e for e in events if e["kind"] == "requeue"], events[-5:]
    assert not [e for e in events if e["kind"] == "restart"]
    assert events[-1]["kind"] == "job_finished" and events[-1]["state"] == "requeue"
    return step


@pytest.mark.slow
def test_signal_to_the_agent_or_its_workers_is_a_requeue_and_the_requeued_job_resumes(
    tmp_path: Path,
) -> None:
    """SIGUSR1 (Slurm's ``--signal=B:USR1@T``) reaches the agent; it forwards the signal, the
    workers save at the next step boundary, wait for the commit and exit 75, and ``trainguard
    run`` exits 75 (torchrun's agent dies on SIGUSR1); the requeued job resumes from that
    checkpoint. SIGTERM (scancel, a time limit) takes the same path from torch's handler on,
    which the agent installs for SIGUSR1 (test_the_agent_handles_sigusr1_as_torch_does_sigterm);
    a worker's save on each signal: test_checkpoint_core's preemption test.

    The requeued job then gets Slurm's ``--signal=USR1@T`` (no ``B:``), which signals every
    process of the step, so the workers see it first: they save and exit 75, and the agent must
    not spend a restart on them (``--max-restarts 3``) but exit 75 itself."""
    env = base_env(TRAINGUARD_CHECKPOINT_DIR=str(tmp_path / "ckpt"))
    p = _start_long_job(tmp_path, env, "run1")
    p.send_signal(signal.SIGUSR1)
    _, err = _requeued(p)
    assert "requeue" in err.splitlines()[-1], err[-2000:]
    step = _preempt_saved_step(tmp_path / "run1", tmp_path / "ckpt")

    # the requeued job resumes from the preemption checkpoint; then its workers are signalled
    p = _start_long_job(tmp_path, env, "run2", "--max-restarts", "3", past=step + 15)
    started = [e for e in _events(tmp_path / "run2") if e["kind"] == "workers_started"]
    for w in started[-1]["workers"]:
        os.kill(w["pid"], signal.SIGUSR1)
    out, _ = _requeued(p)
    assert f"resumed at step {step}" in out, out[-2000:]
    assert _preempt_saved_step(tmp_path / "run2", tmp_path / "ckpt") > step
    failed = [e for e in _events(tmp_path / "run2") if e["kind"] == "worker_failed"]
    # the first rank out exits 75; torch's teardown may SIGTERM a rank still on its way out
    assert any(e["cause"] == "preempted" and e["exitcode"] == 75 for e in failed), failed
    assert {e["cause"] for e in failed} <= {"preempted", "terminated"}, failed


def test_the_agent_handles_sigusr1_as_torch_does_sigterm() -> None:
    """The agent gives the preemption signals torch does not handle torch's own handler (it
    raises SignalException, on which torch's agent forwards the signal to the workers and
    stops them); those torch handles (SIGTERM) are left to torch, whose handler the agent
    wraps after each start of the workers. Either records the signal first: a SignalException
    that an ``except Exception`` on the main thread swallowed is raised again at the next
    monitor pass (else the agent watched on, its workers never told)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from trainguard.core.config.checkpoint import CheckpointConfig
    from trainguard.runtime import _torch
    from trainguard.runtime.agent import raise_swallowed_signal
    from trainguard.runtime.launcher import _handle_preemption_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        torchs = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default
        configured = CheckpointConfig().preemption_signals
        assert {"SIGTERM", "SIGUSR1"} <= set(configured)
        assert _handle_preemption_signals(torchs, configured) == ["SIGUSR1"]
        assert signal.getsignal(signal.SIGUSR1) is _torch.recording_terminate_handler
        assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]
        signal.signal(signal.SIGTERM, _torch.terminate_process_handler)  # torch's, at a start
        _torch.record_terminate_signals()
        assert signal.getsignal(signal.SIGTERM) is _torch.recording_terminate_handler

        raise_swallowed_signal()  # no signal yet: nothing
        with pytest.raises(SignalException) as got:  # delivered: torch's exception, as before
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(5)
        assert got.value.sigval == signal.SIGUSR1
        _torch.forget_signals_raised()
        try:  # a plugin's broad handler on the main thread at that moment
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except Exception:
            pass
        with pytest.raises(SignalException) as got:  # the next monitor pass
            raise_swallowed_signal()
        assert got.value.sigval == signal.SIGTERM
    finally:
        _torch.forget_signals_raised()
        for s, h in before.items():
            signal.signal(s, h)
