"""Loss rollback and goodput under faults.

Unit tests of the anomaly monitor, the rollback ledger, the goodput tracker's rollback
accounting and the rollback counter; then two real 2-process jobs of examples/fault_toy.py:
one with a kill -9, a hang and a NaN loss (rollback, window skipped, weights bitwise equal to a
run that skipped the window from the start, computed in this process; goodput checked against
the script's own timing), and one whose loss stays NaN (rollbacks exhausted → exit 93, no
restart).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from tests.launch_utils import REPO, base_env
from tests.procs import kill_tree
from trainguard.core.config import ConfigError, load_config
from trainguard.core.config.rollback import RollbackConfig
from trainguard.core.events import read_events
from trainguard.core.goodput import GoodputTracker, compute_goodput
from trainguard.recovery.rollback import LossMonitor, RollbackLedger
from trainguard.telemetry.recorder import MetricsRecorder
from trainguard.testing.lineage import chain, productive_s, read_timing

TOY = REPO / "examples" / "fault_toy.py"


# -- pure logic -------------------------------------------------------------------------------
def test_monitor_flags_nonfinite_and_spikes_after_history() -> None:
    m = LossMonitor(RollbackConfig(spike_factor=5.0, window=4, min_history=3))
    assert m.observe(0, 100.0) is None  # no history yet: no spike judgement
    for s, v in enumerate([1.0, 2.0, 1.5], start=1):
        assert m.observe(s, v) is None
    a = m.observe(4, 11.0)  # median of (100, 1, 2, 1.5) = 1.75; 11 > 5 x 1.75
    assert a is not None and a.reason == "spike" and a.median == pytest.approx(1.75)
    assert m.observe(5, 8.0) is None  # the spike was not added to the history: 8 < 8.75
    nan, inf = m.observe(6, float("nan")), m.observe(7, float("-inf"))
    assert nan is not None and nan.reason == "nan" and inf is not None and inf.reason == "inf"
    m.forget_from(2)
    assert [s for s, _ in m._hist] == [1]  # window 4 had dropped step 0; steps >= 2 forgotten
    off = LossMonitor(RollbackConfig(nonfinite=False))
    assert off.observe(0, float("nan")) is None and off.observe(1, "n/a") is None


def test_ledger_escalates_at_the_same_place_then_stops(tmp_path: Path) -> None:
    cfg = RollbackConfig(max_rollbacks=2, place_steps=5, skip_after=1)
    led = RollbackLedger(cfg)
    p1 = led.plan(30)
    assert (p1.count, p1.stop, p1.max_step, p1.first, p1.last) == (1, False, 30, 30, 31)
    assert led.commit(p1, restored_step=28) == (30, 31)  # steps 28, 29 are redone
    assert led.next_step(28) == 28 and led.next_step(30) == 32 and led.should_skip(31)
    p2 = led.plan(33)  # within 5 steps of the window: the same place, an older checkpoint
    assert (p2.count, p2.stop, p2.max_step, p2.first, p2.last) == (2, False, 27, None, 34)
    assert led.commit(p2, restored_step=25) == (25, 34)
    assert led.windows == [(25, 34)] and led.next_step(25) == 35
    assert led.plan(36).stop  # a third anomaly there: exhausted
    far = led.plan(80)  # another place starts again at 1
    assert far.count == 1 and not far.stop and far.max_step == 80
    led.save(tmp_path)
    again = RollbackLedger.load(tmp_path, cfg)
    assert again.windows == [(25, 34)] and again.total == 2 and again.plan(36).stop
    (tmp_path / "rollback.json").write_text("{not json")
    assert RollbackLedger.load(tmp_path, cfg).windows == []


def test_config_section_and_bad_values() -> None:
    cfg = load_config(
        env={"TRAINGUARD_ROLLBACK_SPIKE_FACTOR": "8", "TRAINGUARD_ROLLBACK_WINDOW": "50"}
    )
    assert cfg.rollback.spike_factor == 8.0 and cfg.rollback.window == 50
    with pytest.raises(ConfigError, match=r"\[rollback\]: spike_factor must be > 1"):
        load_config(env={"TRAINGUARD_ROLLBACK_SPIKE_FACTOR": "0.5"})
    with pytest.raises(ConfigError, match="max_rollbacks must be >= 1"):
        load_config(env={"TRAINGUARD_ROLLBACK_MAX_ROLLBACKS": "0"})


def test_goodput_moves_discarded_steps_to_rollback() -> None:
    t = GoodputTracker()
    recs = [{"kind": "step", "step": n, "step_time_s": 1.0, "time": 10.0 + n} for n in range(6)]
    for r in recs:
        t.add(r)
    # steps 4 and 5 discarded (restored step 4), 0.5 s to restore; 4 redone, 5 skipped, 6 new
    t.add({"kind": "log", "step": 5, "rollback_to": 4, "rollback_s": 0.5, "time": 16.5})
    for n, end in ((4, 18.0), (6, 19.0)):
        t.add({"kind": "step", "step": n, "step_time_s": 1.0, "time": end})
    g = t.result([{"kind": "launch", "time": 4.0}, {"kind": "job_finished", "time": 20.0}])
    assert g.productive_s == pytest.approx(6.0)  # steps 0-3, 4 (again) and 6
    assert g.lost_s["rollback"] == pytest.approx(2.5) and g.num_recomputed_steps == 0
    assert g.total_s == pytest.approx(16.0)


def test_rollback_counter_starts_at_zero_and_counts_by_reason() -> None:
    reader = InMemoryMetricReader()
    rec = MetricsRecorder(MeterProvider(metric_readers=[reader]), node="n0")
    rec.event({"kind": "loss_rollback", "time": 1.0, "reason": "nan", "bad_step": 3})
    points = {
        p.attributes["reason"]: p.value
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "trainguard.job.rollbacks"
        for p in m.data.data_points
    }
    assert points == {"nan": 1, "inf": 0, "spike": 0, "other": 0}


def test_a_nan_loss_is_not_set_on_the_loss_gauge() -> None:
    reader = InMemoryMetricReader()
    rec = MetricsRecorder(MeterProvider(metric_readers=[reader]), node="n0")
    rec.record({"kind": "log", "rank": 0, "step": 1, "loss": 0.5})
    rec.record({"kind": "log", "rank": 0, "step": 2, "loss": float("nan")})
    values = [
        p.value
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "trainguard.train.loss"
        for p in m.data.data_points
    ]
    assert values == [0.5] and rec.num_nonfinite == 1 and rec.num_bad_records == 0


def test_lineage_drops_redone_and_discarded_executions() -> None:
    e = [  # A -> B, B -> C (discarded by a rollback to B), B -> D (the survivor), D -> E
        {"before": "A", "after": "B", "t0": 0.0, "t1": 1.0, "loss": "1.0"},
        {"before": "B", "after": "C", "t0": 1.0, "t1": 2.0, "loss": "nan"},
        {"before": "B", "after": "D", "t0": 3.0, "t1": 4.0, "loss": "0.9"},
        {"before": "D", "after": "E", "t0": 4.0, "t1": 5.5, "loss": "0.8"},
    ]
    assert [x["after"] for x in chain(e)] == ["B", "D", "E"]
    assert productive_s(e) == pytest.approx(3.5)
    assert productive_s(e, until=2.0) == 1.0  # broken at 2 s: credited with A -> B
    dead = [*e[:2], {"before": "X", "after": "Y", "t0": 2.5, "t1": 3.0, "loss": "nan"}]
    assert productive_s(dead) == 1.0  # NaN from step 2 on for good (even if hashes differ)


# -- real jobs --------------------------------------------------------------------------------
def _run(run_dir: Path, args: list[str], *, env: dict[str, str], max_restarts: int,
         timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], float, float]:  # fmt: skip
    cmd = [
        sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
        "--tg-run-dir", str(run_dir), str(TOY), *args,
    ]  # fmt: skip
    t0 = time.time()
    p = subprocess.Popen(
        cmd, cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        kill_tree(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err), t0, time.time()


def _env(**extra: str) -> dict[str, str]:
    return base_env(
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
        TRAINGUARD_HEALTH_HANG_TIMEOUT_S="3",
        TRAINGUARD_CHECKPOINT_PERSIST_MODE="thread",
        **extra,
    )


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == kind]


STEPS, KILL, HANG, NAN = 90, 20, 45, 70


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One job with a kill -9 (step 20), a hang (step 45) and a NaN loss (step 70); the run
    that skips step 70's data from the start with no fault is computed in this process
    (``_skipped_window_reference``)."""
    root = tmp_path_factory.mktemp("faulty")
    common = ["--steps", str(STEPS), "--step-sleep", "0.03", "--ckpt-every", "25"]
    run_dir = root / "run"
    p, t_start, t_end = _run(
        run_dir,
        [*common, "--kill-at", str(KILL), "--hang-at", str(HANG), "--nan-at", str(NAN),
         "--out", str(root / "faulty.pt"), "--timing", str(root / "timing.jsonl")],
        env=_env(), max_restarts=3,
    )  # fmt: skip
    return {"root": root, "run_dir": run_dir, "p": p, "t": (t_start, t_end)}


def _skipped_window_reference(steps: int, skip: range, world: int = 2) -> dict[str, torch.Tensor]:
    """The weights ``fault_toy.py --steps steps --skip A-B`` ends with on ``world`` ranks with
    no fault (its defaults), computed in this process as tests/mlp_reference.py computes
    train_mlp.py's (the same model, batches and Adam; each rank's gradient divided by the world
    size, then summed: the bits of DDP over gloo) instead of launching that run."""
    from torch import nn

    make_batch = _toy().make_batch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of several workers
    try:
        torch.manual_seed(0)  # as the script, before it builds the model
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
        params = list(model.parameters())
        opt = torch.optim.Adam(params, lr=1e-2)
        for step in range(steps):
            if step in skip:  # the script skips the window by itself: no optimiser step
                continue
            grads = []
            for rank in range(world):
                x, y = make_batch(step, rank, 16, 32)
                model.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x), y).backward()
                grads.append([q.grad.detach().clone() for q in params])  # type: ignore[union-attr]
            for i, q in enumerate(params):
                g = grads[0][i] / world
                for r in range(1, world):
                    g = g + grads[r][i] / world
                q.grad = g
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _toy() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_fault_toy_example", TOY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.xdist_group("rollback")  # one worker runs the module's job (`faulty`) once
def test_nan_rollback_skips_the_window_and_ends_bitwise_equal(faulty: dict) -> None:
    p, run_dir, root = faulty["p"], faulty["run_dir"], faulty["root"]
    assert p.returncode == 0, p.stderr[-4000:]
    [rb] = _events(run_dir, "loss_rollback")
    assert (rb["bad_step"], rb["restored_step"], rb["skip"], rb["reason"]) == (
        NAN,
        NAN,
        [NAN, NAN],
        "nan",
    )
    assert rb["resume_step"] == NAN + 1 and rb["rollbacks_here"] == 1
    restored = [e for e in _events(run_dir, "checkpoint_restored") if e["time"] >= rb["time"] - 5]
    assert {e["source"] for e in restored if e.get("step") == NAN} == {"memory"}
    assert (
        f"loss is nan at step {NAN}: rolled back to step {NAN}, skipping steps {NAN}-{NAN}"
        in p.stderr
    )
    assert f"skipped [({NAN}, {NAN})]" in p.stdout
    # the other faults happened and were recovered
    assert [e["signal"] for e in _events(run_dir, "worker_failed") if e["root_cause"]][
        0
    ] == "SIGKILL"
    assert len(_events(run_dir, "hang_detected")) == 1
    assert _events(run_dir, "job_finished")[-1]["state"] == "succeeded"
    a, b = torch.load(root / "faulty.pt"), _skipped_window_reference(STEPS, range(NAN, NAN + 1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "1 loss rollback" in p.stderr and f"loss nan at step {NAN}" in p.stderr
    from trainguard.telemetry.report import write_report

    html = write_report(run_dir).read_text()
    assert "loss rollbacks</td><td>1<" in html and 'class="tg-rollback-row"' in html


@pytest.mark.slow
@pytest.mark.xdist_group("rollback")
def test_goodput_matches_an_independent_measurement(faulty: dict) -> None:
    """trainguard's goodput (the report's and the agent's telemetry) against the script's own
    timing and the test's clock, under a kill -9, a hang and a rollback."""
    p, run_dir, root = faulty["p"], faulty["run_dir"], faulty["root"]
    assert p.returncode == 0, p.stderr[-4000:]
    execs = read_timing(root / "timing.jsonl")
    good = chain(execs)
    assert [e["step"] for e in good] == [s for s in range(STEPS) if s != NAN]
    indep_productive = productive_s(execs)
    bad = [e for e in execs if e["step"] == NAN]  # the discarded execution
    assert len(bad) == 1 and not math.isfinite(float(bad[0]["loss"]))

    data = read_events(run_dir)
    from trainguard.telemetry.report import load_run

    recs = [r for rs in load_run(run_dir).records.values() for r in rs]
    g = compute_goodput(data, recs)
    summary = (run_dir / "telemetry").glob("summary_*.json")
    import json

    [agent] = [json.loads(s.read_text())["goodput"] for s in summary]
    for gg in (g.to_dict(), agent):  # the report's and the agent's (Prometheus) numbers
        assert gg["productive_s"] == pytest.approx(indep_productive, rel=0.02, abs=0.05)
        wall = faulty["t"][1] - faulty["t"][0]
        assert wall - 15 < gg["total_s"] <= wall  # launcher process start → job_finished
        assert gg["ettr"] == pytest.approx(gg["productive_s"] / gg["total_s"])
        lost = gg["lost_s"]
        # the rollback: the discarded NaN step plus the restore
        rb = _events(run_dir, "loss_rollback")[0]
        bad_dt = bad[0]["t1"] - bad[0]["t0"]
        assert (
            bad_dt + rb["duration_s"] - 0.02 <= lost["rollback"] <= bad_dt + rb["duration_s"] + 0.1
        )
        # kill and hang: from the last step done before each fault to the first step of the
        # attempt after it, as the script saw it
        outage = 0.0
        t_kill = float((run_dir / f"killed_at_{KILL}").read_text())
        t_hang = float((run_dir / f"hang_started_{HANG}").read_text())
        for t_fault in (t_kill, t_hang):
            before = max(e["t1"] for e in execs if e["t1"] <= t_fault)
            after = min(e["t0"] for e in execs if e["t0"] >= t_fault)
            outage += after - before
        [hang] = _events(run_dir, "hang_detected")
        fault_lost = lost["restart"] + lost["hang"] + lost["rendezvous"] - _first_rdzv(data)
        # equal to the ms on an idle box; seen 2.5 s apart on a host at load 20 (not explained yet)
        assert fault_lost == pytest.approx(outage, abs=max(1.0, 0.1 * outage)), (lost, outage)
        assert lost["hang"] == pytest.approx(hang["time"] - t_hang, abs=1.0)
        assert lost["recomputed_steps"] < 0.5
        assert lost["other"] < 0.25 * gg["total_s"], lost


def _first_rdzv(events: list[dict]) -> float:
    return sum(
        e.get("duration_s") or 0.0
        for e in events
        if e["kind"] == "rendezvous" and e["attempt"] == 0
    )


def test_loss_that_stays_nan_stops_the_job_with_93(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p, _, _ = _run(
        run_dir,
        ["--steps", "60", "--nan-from", "30", "--ckpt-every", "0"],
        env=_env(TRAINGUARD_ROLLBACK_MAX_ROLLBACKS="2", TRAINGUARD_TELEMETRY_ENABLED="false"),
        max_restarts=2,
    )
    assert p.returncode == 93, p.stderr[-3000:]
    rbs = _events(run_dir, "loss_rollback")
    assert [(e["bad_step"], e["restored_step"], e["skip"]) for e in rbs] == [
        (30, 30, [30, 30]),
        (31, 29, [29, 31]),  # the same place again: an older snapshot, a wider window
    ]
    [stop] = _events(run_dir, "rollback_exhausted")
    assert stop["bad_step"] == 32 and stop["exitcode"] == 93
    assert not _events(run_dir, "restart") and _events(run_dir, "do_not_requeue")
    lines = [ln for ln in p.stderr.splitlines() if "loss anomaly at step 32" in ln]
    assert len(lines) == 2 and "exit code 93 (do not requeue)" in lines[0]  # the line + summary
    assert "Traceback" not in p.stderr
    last = p.stderr.splitlines()[-1]  # the recovery policy's stop line (a job-wide stop)
    assert "exited with 93" in last and "exit 93: do not requeue" in last, last
