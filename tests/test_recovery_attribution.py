"""Failure attribution (unit): error files, tracebacks and exits → cause and verdict; the
goodput accounting of a job that never did a step. Real jobs: tests/test_recovery_verdicts.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainguard.core.errorfile import exception_site
from trainguard.core.failures import FailureKind, WorkerFailure, classify_exit
from trainguard.core.goodput import compute_goodput
from trainguard.recovery.attribution import Cause, Verdict, attribute, oom_figure

SHAPE = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x4 and 5x6)"
TB = """Traceback (most recent call last):
  File "/home/u/train.py", line 40, in <module>
    main()
  File "/home/u/train.py", line 33, in main
    step(i)
  File "/home/u/train.py", line 21, in step
    torch.matmul(a, b)
  File "{lib}/torch/functional.py", line 9, in matmul
    return _C.mm(a, b)
{head}
"""


def _tb(head: str | None = None, lib: str = "/usr/lib/python3/site-packages") -> str:
    return TB.format(lib=lib, head=head or SHAPE)


def exc(rank: int, message: str, stack: str | None = None, *, pid: int = 0) -> WorkerFailure:
    data = {"message": {"message": message, "extraInfo": {"py_callstack": stack or ""}}}
    return classify_exit(rank=rank, local_rank=rank, exitcode=1, error_file_data=data, pid=pid)


def test_exception_site_user_frame() -> None:
    site = exception_site(SHAPE, _tb())
    assert site is not None
    assert (site.type, site.file, site.line, site.func) == (
        "RuntimeError",
        "/home/u/train.py",
        21,
        "step",
    )
    assert site.raised_in == "/usr/lib/python3/site-packages/torch/functional.py:9"
    assert site.signature() == "RuntimeError@/home/u/train.py:21"
    # no traceback: the message alone names the type
    bare = exception_site("ValueError: bad", None)
    assert bare is not None and (bare.type, bare.file) == ("ValueError", None)
    assert exception_site(None, None) is None


def test_user_code_on_every_rank_stops_once_on_one_rank_restarts() -> None:
    every = attribute([exc(0, SHAPE, _tb()), exc(1, SHAPE, _tb())], world_size=2)
    assert (every.cause, every.verdict, every.deterministic) == (
        Cause.USER_CODE,
        Verdict.STOP,
        True,
    )
    assert every.evidence["place"] == "/home/u/train.py:21" and every.ranks == [0, 1]
    assert "RuntimeError" in every.summary and "train.py:21" in every.summary
    # one rank of two, once: not decided — a restart tells
    once = attribute([exc(0, SHAPE, _tb())], world_size=2)
    assert (once.cause, once.verdict, once.deterministic) == (
        Cause.USER_CODE,
        Verdict.RESTART,
        False,
    )
    # ... the same place in the next attempt: deterministic
    again = attribute([exc(0, SHAPE, _tb())], world_size=2, previous_signature=once.signature)
    assert again.verdict is Verdict.STOP and "two failed attempts" in again.summary
    # the survivor's collective error does not count against "every rank", nor make it user code
    peer = exc(1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:2345")
    mixed = attribute([exc(0, SHAPE, _tb()), peer], world_size=2)
    assert mixed.cause is Cause.USER_CODE and mixed.verdict is Verdict.RESTART
    # different places on the two ranks: not one bug
    other = _tb().replace("line 21", "line 22")
    split = attribute([exc(0, SHAPE, _tb()), exc(1, SHAPE, other)], world_size=2)
    assert split.verdict is Verdict.RESTART


def test_transient_faults_never_stop() -> None:
    killed = classify_exit(rank=0, local_rank=0, exitcode=-9, pid=7)
    survivor = exc(1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:2345")
    for failures, hang in (([killed, survivor], False), ([killed], True)):
        a = attribute(failures, world_size=2, hang=hang)
        assert a.verdict is not Verdict.STOP, a
    a = attribute([killed, survivor], world_size=2)
    # the killed rank is the cause, its peer's lost connection the consequence
    assert (a.cause, a.ranks) == (Cause.TRANSIENT, [0]), a
    assert a.summary.startswith("rank(s) 0 ended by SIGKILL; rank(s) 1 lost the connection"), a
    assert attribute([survivor], world_size=2).cause is Cause.NETWORK  # no kill: the network
    # a kill next to a user exception on every other rank: not decided at once
    a = attribute([killed, exc(1, SHAPE, _tb())], world_size=2)
    assert a.verdict is Verdict.RESTART
    # an OSError (a flaky file system) on every rank is the environment's, not the code's
    ioe = "OSError: [Errno 5] Input/output error"
    io = [exc(r, ioe, _tb(ioe)) for r in (0, 1)]
    assert attribute(io, world_size=2).verdict is Verdict.RESTART
    fpe = "FloatingPointError: loss is nan at step 3"
    nan = attribute([exc(0, fpe, _tb(fpe))], world_size=1)
    assert (nan.cause, nan.verdict) == (Cause.DATA, Verdict.ROLLBACK)
    dse = "DistStoreError: Timed out after 300 s"
    store = attribute([exc(0, dse, _tb(dse))], world_size=1)
    assert (store.cause, store.verdict) == (Cause.CONTROL_PLANE, Verdict.RETRY)
    health = [
        {"action": "drain", "reasons": ["XID 79 on GPU 3 (fallen off the bus)"], "ranks": [0]}
    ]
    hw = attribute([killed], world_size=2, health=health)
    assert (hw.cause, hw.verdict) == (Cause.HARDWARE, Verdict.EVICT)
    assert "XID 79" in hw.summary


def test_a_rank_named_by_the_replicas_check_evicts_its_node() -> None:
    from trainguard.core.failures import SDC_EXIT_CODE

    named = classify_exit(rank=1, local_rank=0, exitcode=SDC_EXIT_CODE, pid=7)
    other = classify_exit(rank=0, local_rank=1, exitcode=1, pid=8)
    a = attribute([other, named], world_size=4)
    assert (a.cause, a.verdict, a.ranks) == (Cause.SDC, Verdict.EVICT, [1]), a
    assert a.summary.startswith("silent data corruption: the replicas' check named rank(s) 1")
    # its peers' exits (a consequence) say nothing of it
    assert attribute([other], world_size=4).cause is not Cause.SDC


def test_out_of_memory_names_the_figure() -> None:
    msg = "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has ..."
    a = attribute([exc(0, msg, _tb(msg))], world_size=4)
    assert (a.cause, a.verdict) == (Cause.OUT_OF_MEMORY, Verdict.STOP)
    assert a.evidence["figure"] == "20.00 GiB" and "20.00 GiB" in a.summary
    assert oom_figure("nothing") is None


def test_hook_writes_torch_error_file(tmp_path: Path) -> None:
    """The excepthook (as the workers' start-up hook installs it) in a real interpreter: torch's
    format, then Python's usual traceback; a file ``@record`` wrote is left alone."""
    script = tmp_path / "boom.py"
    script.write_text(
        "from trainguard.core.errorfile import install_excepthook\n"
        "install_excepthook()\n"
        "def f():\n    raise KeyError('missing')\n"
        "f()\n"
    )
    err = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(err)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert p.returncode == 1 and "KeyError: 'missing'" in p.stderr
    data = json.loads(err.read_text())
    f = classify_exit(rank=0, local_rank=0, exitcode=1, error_file_data=data)
    assert f.kind is FailureKind.EXCEPTION and f.message == "KeyError: 'missing'"
    site = exception_site(f.message, f.callstack)
    assert site is not None and site.place == f"{script}:4" and site.func == "f"
    err.write_text('{"message": "written by @record"}')
    subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert json.loads(err.read_text()) == {"message": "written by @record"}


def test_goodput_of_a_job_that_never_stepped_adds_up() -> None:
    """Four attempts that each fail before a step: the restart time is the gaps between them,
    not four overlapping spans to the end (it used to exceed the wall time)."""
    events = [{"kind": "launch", "time": 0.0, "process_start": 0.0}]
    for a in range(4):
        t = 10.0 + 12.0 * a
        events.append({"kind": "rendezvous", "time": t - 2, "attempt": a, "duration_s": 1.0})
        events.append({"kind": "worker_failed", "time": t, "attempt": a, "cause": "exception"})
    events.append({"kind": "job_finished", "time": 50.0, "state": "failed"})
    g = compute_goodput(events, [])
    assert g.total_s == 50.0
    assert sum(g.lost_s.values()) + g.productive_s == g.total_s
    assert g.lost_s["startup"] == 9.0  # launch → first failure, less its rendezvous
    assert g.lost_s["rendezvous"] == 4.0
    assert g.lost_s["restart"] == 3 * 11.0 + 4.0  # gaps less the rendezvous; last → end
    assert g.lost_s["other"] == 0.0


def test_two_nodes_same_user_error_stop_with_a_real_store() -> None:
    """Each agent sees its own rank (one of two): the node that completes the count in the
    job's store (a real TCPStore, two clients) stops the job; a peer's error alone does not."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from trainguard.core.config.recovery import RecoveryConfig
    from trainguard.recovery.ledger import JobLedger
    from trainguard.recovery.policy import RecoveryAction, RecoveryPolicy

    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    cfg = RecoveryConfig(backoff_base_s=0.0)
    a = RecoveryPolicy(cfg, JobLedger(server, "job"), node="a")
    b = RecoveryPolicy(cfg, JobLedger(client, "job"), node="b")
    da = a.decide(0, [exc(0, SHAPE, _tb())], world_size=2, evictable=False)
    assert da.action is RecoveryAction.RESTART and da.attribution["verdict"] == "restart"
    db = b.decide(0, [exc(1, SHAPE, _tb())], world_size=2, evictable=False)
    assert db.action is RecoveryAction.STOP and "on all 2 rank(s) of the job" in db.reason
    # the other agent learns the stop before its next rendezvous
    assert JobLedger(server, "job").stopped() is not None
    # another job: one node's user error, the other node's ranks lost their peer: restart
    c = RecoveryPolicy(cfg, JobLedger(server, "job2"), node="a")
    d = RecoveryPolicy(cfg, JobLedger(client, "job2"), node="b")
    peer = exc(1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:2345")
    assert (
        c.decide(0, [exc(0, SHAPE, _tb())], world_size=2, evictable=False).action
        is RecoveryAction.RESTART
    )
    assert d.decide(0, [peer], world_size=2, evictable=False).action is RecoveryAction.RESTART
    del client, server
