"""Silent data corruption: the replicas' digest, the injector, the settings, and one real job.

- the digest sees every single flipped bit of a tensor (each bit of a few elements flipped by
  the chaos injector's own ``corrupt``), and the tensors it covers (DDP model, optimizer);
- state that is not replicated (a model outside DDP, parameters DDP ignores) switches the checks
  off with one line, and bad ``[sdc]`` settings are one-line errors;
- a real 2-rank DDP job (gloo, CPU) under ``trainguard run`` with one bit of rank 1's reduced
  gradient flipped at step 13: the replicas disagree at the next check, the job rolls back to
  the last agreed step, replays (rank 1's loss differs from its first run's one step before
  rank 0's), names rank 1 (an ``sdc`` record of its node in the fleet database), commits no
  checkpoint of the corrupted state, and ends with the weights of a fault-free run, bitwise. (Four ranks and the majority verdict:
  bench/sdc.py.)
- two nodes and a spare: the named node is evicted (exit 95 from its worker, cause sdc, exit
  94), the fleet database counts it toward the lemon policy, the spare finishes the job from
  the last agreed checkpoint, and every manifest says its state passed the check;
- a parameter excluded from DDP: checks off with one line, no verdict, checkpoints marked
  unverified; a bad cadence at launch: one line, no worker started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.launch_utils import REPO, base_env
from tests.mlp_reference import assert_same_as_reference
from trainguard.chaos import faults as chaos
from trainguard.core.config import ConfigError, load_config
from trainguard.worker.sdc import NotReplicated, digest, known_answer_gemm_ok, replicated_tensors

EXAMPLE = str(REPO / "examples" / "train_mlp.py")


def test_every_single_bit_flip_changes_the_digest() -> None:
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g).to(torch.bfloat16)]
    base = digest(tensors)
    for t in tensors:
        bits = 8 * t.element_size()
        for index in (0, t.numel() - 1):
            for bit in range(bits):
                fault = chaos.Fault(kind="sdc", step=0, bit=bit, index=index)
                chaos.corrupt(t, fault)
                got = digest(tensors)
                assert got[0] != base[0] and got[1] != base[1], (t.dtype, index, bit)
                chaos.corrupt(t, fault)  # flipped back
                assert digest(tensors) == base
    # scaling one element changes it too
    chaos.corrupt(tensors[0], chaos.Fault(kind="sdc", step=0, scale=1.5, index=3))
    assert digest(tensors) != base
    assert known_answer_gemm_ok(torch.device("cpu"))


def test_two_rank_record_follows_the_parameters_and_yields_to_the_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The per-step record (two ranks) reads the parameters through views made once: it sees
    an optimizer's in-place update and one flipped bit, remakes its views when a parameter's
    storage moves, and where the records alone take over half the budget the job compares the
    logged metric instead (one line)."""
    from types import SimpleNamespace

    from trainguard.core.config.sdc import SdcConfig
    from trainguard.worker import sdc as sdc_mod

    net = nn.Linear(4, 3)
    state = {"model": net}
    records: list[dict[str, object]] = []
    tg = SimpleNamespace(world_size=2, rank=0, generation=0, _write_record=records.append)
    guard = sdc_mod.SdcGuard(tg, SdcConfig(budget=0.001))
    guard.due(0, persist=False)
    guard.boundary(0, state)
    first = guard._values[0]
    with torch.no_grad():
        net.weight.add_(1.0)  # in place, as an optimizer step
    guard.boundary(1, state)
    assert guard._values[1] != first
    chaos.corrupt(net.bias, chaos.Fault(kind="sdc", step=0, bit=0, index=1))
    guard.boundary(2, state)
    assert guard._values[2] != guard._values[1]
    net.weight = nn.Parameter(net.weight.detach().clone() * 2)  # new storage: views remade
    guard.boundary(3, state)
    assert guard._values[3] == sum(
        int(t.detach().reshape(-1).view(torch.int32).sum(dtype=torch.int64))
        for t in (net.weight, net.bias)
    )
    assert guard.record_steps
    guard.record_s = 1e6  # records that cost far more than the budget
    with caplog.at_level("WARNING"):
        for step in range(4, sdc_mod._RECORD_PROBE_STEPS + 1):
            guard.boundary(step, state)
    assert not guard.record_steps and guard._values == {}
    (line,) = [r.getMessage() for r in caplog.records if "per-step parameter digests" in r.message]
    assert "'loss'" in line and "budget" in line
    guard.observe(300, {"loss": 0.5})  # the metric is kept from now on
    assert guard._values == {300: 0.5}


_DDP_CHECKS = """
import os, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from trainguard.worker.sdc import NotReplicated, replicated_tensors

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
opt = torch.optim.Adam(net.parameters())
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
model = DDP(net)
net(torch.randn(2, 4)).sum().backward()
opt.step()
got = replicated_tensors({"model": model, "optim": opt, "extra": {"t": torch.ones(2)}})
# 4 parameters, 3 BatchNorm buffers, Adam's step/exp_avg/exp_avg_sq of each parameter
assert len(got) == 4 + 3 + 4 * 3 + 1, len(got)
ignored = nn.Linear(2, 2)
DDP._set_params_and_buffers_to_ignore_for_model(ignored, ["bias"])
try:
    replicated_tensors({"model": DDP(ignored)})
    raise SystemExit("a parameter excluded from DDP was compared")
except NotReplicated as e:
    assert "excludes bias from DDP: those replicas are not" in str(e), e
print("checked", flush=True)
os._exit(0)  # no teardown: a gloo group's destructor joins its threads with the GIL held
"""


def test_what_is_compared_and_what_is_refused(tmp_path: Path) -> None:
    """What the replica check compares (DDP parameters, buffers and the optimizer's state)
    and what it refuses (a module that is not replicated, a parameter DDP ignores). The DDP
    part runs in a process of its own: a gloo group's destructor, run by a DDP reducer's
    deallocation in the test process, once hung a suite worker for good (joining its threads
    with the interpreter lock held)."""
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.Adam(net.parameters())
    with pytest.raises(NotReplicated, match=r"state\['model'\] is a Sequential, not a Distr"):
        replicated_tensors({"model": net, "optim": opt})
    out = subprocess.run(
        [sys.executable, "-c", _DDP_CHECKS, str(tmp_path / "store")],
        env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "checked", out.stderr[-3000:]


def test_bad_settings_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value, what in (
        ("EVERY_STEPS", "0", "every_steps must be >= 1"),
        ("EVERY_STEPS", "-3", "every_steps must be >= 1"),
        ("BUDGET", "0.00001", "budget must be between 0.0001 and 0.5"),
        ("BUDGET", "0", "budget must be between"),
    ):
        monkeypatch.setenv(f"TRAINGUARD_SDC_{key}", value)
        with pytest.raises(ConfigError, match=what) as info:
            load_config()
        assert "\n" not in str(info.value) and "[sdc]" in str(info.value)
        monkeypatch.delenv(f"TRAINGUARD_SDC_{key}")
    for bad, what in (
        ("sdc:rank=1", "sdc needs step=S"),
        ("sdc:step=3,bit=32", "bit='32'"),
        ("sdc:step=3,bit=4,scale=2", "not both"),
        ("sdc:step=3,target=optim", "target='optim'"),
    ):
        with pytest.raises(chaos.ChaosSpecError, match=what):
            chaos.parse_spec(bad)
    (f,) = chaos.parse_spec("sdc:rank=1,step=7,param=2,index=5")
    assert (f.bit, f.target, f.param, f.index) == (22, "grad", 2, 5)


# torch's error handler enables faulthandler on stderr, which pytest's capture has no fd for
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_flipped_gradient_bit_found_named_and_rolled_back(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = base_env()
    env["TRAINGUARD_CHAOS"] = "sdc:rank=1,step=13,bit=20,param=0,index=9"
    env["TRAINGUARD_SDC_ENABLED"] = "true"
    env["TRAINGUARD_SDC_EVERY_STEPS"] = "8"  # checks at 1, 9, 17, ... (and every save)
    env["TRAINGUARD_RUNTIME_RUNS_ROOT"] = str(tmp_path)  # the fleet database
    cmd = [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
           "--tg-run-dir", str(run_dir), EXAMPLE, "--steps", "30", "--ckpt-every", "15",
           "--out", str(tmp_path / "final.pt")]  # fmt: skip
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    (suspect,) = [e for e in events if e["kind"] == "sdc_suspect"]
    # the flip is in step 13's optimizer step: the boundary of 14 steps done is the first to
    # see it. Every save is checked first (memory-tier snapshots included), so the first check
    # from 14 on finds it, and the one before it is the last agreed state
    recs = (run_dir / "metrics" / "rank_0.jsonl").read_text().splitlines()
    checks = [r["step"] for r in map(json.loads, recs) if r.get("kind") == "sdc_check"]
    found = next(s for s in checks if s >= 14)
    agreed = max(s for s in checks[: checks.index(found)])
    assert suspect["step"] == found and 14 <= found <= 15, (suspect, checks)
    assert suspect["localise"] == "replay", suspect
    assert suspect["last_agreed_step"] == agreed <= 13
    (rollback,) = [e for e in events if e["kind"] == "sdc_rollback"]
    assert rollback["bad_step"] == found and rollback["restored_step"] <= agreed
    (verdict,) = [e for e in events if e["kind"] == "sdc_verdict"]
    assert verdict["ranks"] == [1] and verdict["localise"] == "replay", verdict
    (named,) = [e for e in events if e["kind"] == "sdc_rank_named"]
    assert named["rank"] == 1 and named["device"] == "cpu"
    committed = [e for e in events if e["kind"] == "checkpoint_committed"]
    before = [e["step"] for e in committed if e["time"] < rollback["time"]]
    assert all(s < found for s in before) and [e["step"] for e in committed][-2:] == [15, 30]
    assert kinds.index("sdc_verdict") > kinds.index("sdc_rollback")
    assert f"silent data corruption at step {found}: rank(s) 1" in p.stderr
    # the named rank's node is in the fleet database with cause sdc
    from trainguard.fleet.db import open_db

    with open_db("", runs_root=tmp_path) as db:
        (record,) = [r for r in db.history() if r.kind == "sdc"]
    assert record.cause == "sdc" and record.detail["rank"] == 1 and record.detail["step"] == found
    # the rollback and the redo end where a run without the flip ends, bitwise
    assert_same_as_reference(tmp_path / "final.pt", 30)
    assert os.path.getsize(tmp_path / "final.pt") > 0


@pytest.mark.timeout(500)
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_named_node_evicted_and_a_spare_takes_over(tmp_path: Path) -> None:
    """Two nodes (one rank each) and a spare: a bit of n1's reduced gradient flipped at step 13.
    The replay names n1's rank; its worker exits 95, its agent attributes the round to ``sdc``
    and evicts the node (exit 94, as for a health drain), the fleet database counts it toward
    the lemon policy, and the spare n2 takes its place: the job finishes from the last agreed
    checkpoint. Every checkpoint's manifest says its state passed the check at its step."""
    from tests.health_fixtures.jobs import wait_for_event
    from tests.launch_utils import free_port, wait_listening
    from tests.procs import kill_tree
    from trainguard.core.config.fleet import FleetConfig
    from trainguard.core.failures import EVICTED_EXIT_CODE
    from trainguard.fleet.db import open_db
    from trainguard.fleet.lemons import lemon_status

    run_dir, port = tmp_path / "run", free_port()
    env = base_env(
        TRAINGUARD_CHAOS="sdc:node=n1,step=13,bit=20,param=0,index=9",
        TRAINGUARD_SDC_EVERY_STEPS="4",
        TRAINGUARD_RUNTIME_RUNS_ROOT=str(tmp_path),  # the fleet database
        TRAINGUARD_TELEMETRY_ENABLED="false",
        TRAINGUARD_CHECKPOINT_MEMORY_TIER="false",
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
        TRAINGUARD_HEALTH_MIN_FREE_DISK_GIB="0",
        TRAINGUARD_HEALTH_MIN_FREE_MEMORY_GIB="0",
        TRAINGUARD_RECOVERY_BACKOFF_BASE_S="0",
        TRAINGUARD_RECOVERY_FAILURE_GRACE_S="10",
    )
    env["TRAINGUARD_SDC_ENABLED"] = "true"  # base_env switches it off
    agents: dict[str, subprocess.Popen[str]] = {}
    try:
        for node in ("n0", "n1", "n2"):
            agents[node] = subprocess.Popen(
                [sys.executable, "-m", "trainguard", "run", "--nnodes", "2", "--nproc-per-node",
                 "1", "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 f"127.0.0.1:{port}", "--rdzv-id", "sdc", "--tg-run-dir", str(run_dir), EXAMPLE,
                 "--steps", "30", "--ckpt-every", "5", "--step-sleep", "0.05"],
                cwd=REPO, env={**env, "SLURMD_NODENAME": node}, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                start_new_session=True,
            )  # fmt: skip
            if node == "n0":
                wait_listening(port)
            if node == "n1":  # n2 comes once the round of n0 and n1 runs: the spare
                wait_for_event(run_dir, "workers_started", timeout=240, count=2)
        codes = {n: p.wait(timeout=400) for n, p in agents.items()}
        errs = {n: p.stderr.read() if p.stderr else "" for n, p in agents.items()}
    finally:
        for p in agents.values():
            kill_tree(p)
    assert codes == {"n0": 0, "n1": EVICTED_EXIT_CODE, "n2": 0}, errs
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    (verdict,) = [e for e in events if e["kind"] == "sdc_verdict"]
    (named,) = [e for e in events if e["kind"] == "sdc_rank_named"]
    assert named["node"] == "n1" and verdict["ranks"] == [named["rank"]], (verdict, named)
    (attr,) = [e for e in events if e["kind"] == "failure_attributed" and e["node"] == "n1"]
    assert attr["cause"] == "sdc" and attr["verdict"] == "evict", attr
    (evicted,) = [e for e in events if e["kind"] == "node_evicted"]
    assert evicted["node"] == "n1" and "sdc" in evicted["reason"], evicted
    assert {e["node"] for e in events if e["kind"] == "workers_started"} == {"n0", "n1", "n2"}
    assert "leaves the job (exit 95: evicted)" in errs["n1"] and "Traceback" not in errs["n1"]
    # the restarted round resumed from a checkpoint at or before the last agreed step
    (suspect,) = [e for e in events if e["kind"] == "sdc_suspect"]
    committed = [e for e in events if e["kind"] == "checkpoint_committed"]
    assert all(e["sdc"] == "verified" for e in committed), committed
    kept = [Path(e["path"]) for e in committed if Path(e["path"]).exists()]  # retention
    assert kept and kept[-1].name == "step_00000030"
    for path in kept:
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["extra"] == {"sdc": "verified"}, manifest
    bad = [e["step"] for e in committed if e["time"] < verdict["time"]]
    assert all(s <= suspect["last_agreed_step"] for s in bad), (bad, suspect)
    restored = [
        e for e in events if e["kind"] == "checkpoint_restored" and e["time"] > evicted["time"]
    ]
    assert restored and all(e["step"] <= suspect["last_agreed_step"] for e in restored), restored
    assert [e["step"] for e in committed][-1] == 30
    # the fleet database: n1's records with cause sdc count toward the lemon policy
    with open_db("", runs_root=tmp_path) as db:
        causes = {(r.kind, r.cause) for r in db.history("n1")}
        lemon = lemon_status(db, "n1", FleetConfig(lemon_failures=1))
    assert ("sdc", "sdc") in causes and lemon.is_lemon and lemon.incidents == 1, (causes, lemon)


def test_replicas_not_meant_to_be_equal_checks_off_one_line(tmp_path: Path) -> None:
    """A parameter excluded from DDP (its replicas drift apart by design): the checks switch
    off with one line and no verdict, and the checkpoints are marked unverified."""
    run_dir = tmp_path / "run"
    env = base_env(TRAINGUARD_TELEMETRY_ENABLED="false")
    env.update(TRAINGUARD_SDC_ENABLED="true", TRAINGUARD_SDC_EVERY_STEPS="1")
    cmd = [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
           "--tg-run-dir", str(run_dir), EXAMPLE, "--steps", "6", "--ckpt-every", "3",
           "--ddp-ignore", "2.bias"]  # fmt: skip
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if "sdc checks off" in x]
    assert len(lines) == 1 and "excludes 2.bias from DDP" in lines[0], p.stderr[-2000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("sdc_checks_off") == 1
    assert not {"sdc_suspect", "sdc_verdict", "sdc_rollback"} & set(kinds)
    committed = [e for e in events if e["kind"] == "checkpoint_committed"]
    assert [e["step"] for e in committed] == [3, 6]
    for e in committed:
        manifest = json.loads((Path(e["path"]) / "manifest.json").read_text())
        assert manifest["extra"]["sdc"] == "unverified" == e["sdc"]
        assert "excludes 2.bias from DDP" in manifest["extra"]["sdc_reason"]


def test_a_bad_cadence_at_launch_is_one_line(tmp_path: Path) -> None:
    """A cadence of 0, a budget below the minimum: `trainguard run` refuses before any worker
    starts, with one line naming the setting and how to fix it."""
    for key, value, what in (
        ("EVERY_STEPS", "0", "[sdc]: every_steps must be >= 1 (check every N steps), not 0"),
        ("BUDGET", "0.00001", "[sdc]: budget must be between 0.0001 and 0.5"),
    ):
        env = {**base_env(), "TRAINGUARD_SDC_ENABLED": "true", f"TRAINGUARD_SDC_{key}": value}
        cmd = [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
               "--tg-run-dir", str(tmp_path / key), EXAMPLE, "--steps", "3"]  # fmt: skip
        p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr[-2000:]
        assert p.stderr.strip().count("\n") == 0 and what in p.stderr, p.stderr
        assert (
            not (tmp_path / key / "events.jsonl").exists()
            or "workers_started" not in (tmp_path / key / "events.jsonl").read_text()
        )
