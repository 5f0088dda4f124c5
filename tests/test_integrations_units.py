"""The integrations' shared logic: metric names onto the contract, values that must never
crash training, the step heartbeat split over begin/end hooks, the lazy imports."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainguard.integrations.common import MetricMapper, SafeTelemetry, StepBeat, batch_amounts
from trainguard.worker.api import TrainGuard

REPO = Path(__file__).resolve().parent.parent


def test_hf_and_trl_names_map_onto_the_contract() -> None:
    m = MetricMapper()
    out = m.map(
        {
            "loss": 1.5,
            "learning_rate": 1e-3,
            "grad_norm": torch.tensor(2.0),
            "reward": 0.5,
            "reward_std": 0.1,
            "kl": 0.01,
            "entropy": 2.0,
            "clip_ratio/region_mean": 0.0,
            "completions/mean_length": 4.5,
            "completions/max_length": 8,
            "rewards/sevens/mean": 0.25,
            "epoch": 0.1,
            "time": 3.0,
            "rank": 1,
            "step": 7,
            "missing": None,
            "vector": torch.ones(3),
            "nested": {"a": 1, "b": {"c": 2}},
        }
    )
    assert out["loss"] == 1.5 and out["learning_rate"] == 1e-3 and out["grad_norm"] == 2.0
    assert out["clip_ratio"] == 0.0 and out["response_length"] == 4.5
    assert out["response_length_max"] == 8 and out["rewards/sevens/mean"] == 0.25
    assert out["time_value"] == 3.0 and out["rank_value"] == 1 and out["step_value"] == 7
    assert out["nested/a"] == 1 and out["nested/b/c"] == 2
    assert "missing" not in out and "vector" not in out and m.dropped == 2


def test_lightning_user_names_map_onto_the_contract() -> None:
    m = MetricMapper(strip_prefixes=True)
    out = m.map({"train_loss_step": torch.tensor(0.5), "lr-AdamW": 0.1, "val_loss": 1.0})
    assert out == {"loss": 0.5, "lr": 0.1, "val_loss": 1.0}
    both = MetricMapper(strip_prefixes=True).map({"train/loss": 1, "loss": 2})
    assert both == {"loss": 2, "train/loss": 1}  # the contract's own name wins, the other stays


def test_nan_is_kept_and_logging_never_raises(tmp_path: Path) -> None:
    tg = TrainGuard(run_dir=tmp_path)
    t = SafeTelemetry(tg, "test")
    t.log(3, MetricMapper().map({"loss": float("nan"), "kind": "x"}))
    t.log(3, {"time": 1.0})  # reserved: tg.log raises; counted, not raised
    assert t.failures == 1
    tg.close()
    import json

    [rec] = [
        json.loads(x) for x in (tmp_path / "metrics" / "rank_0.jsonl").read_text().splitlines()
    ]
    assert math.isnan(rec["loss"]) and rec["kind_value"] == "x" and rec["step"] == 3


def test_step_beat_follows_the_framework_step(tmp_path: Path) -> None:
    tg = TrainGuard(run_dir=tmp_path)
    beat = StepBeat(SafeTelemetry(tg, "test"))
    beat.begin(41, tokens=10, samples=2)
    assert beat.open and tg.step_num == 0
    beat.begin(42)  # a begin without an end closes the open step first
    beat.end()
    beat.end()  # idempotent
    assert tg.step_num == 43 and not beat.open
    tg.close()


def test_batch_amounts() -> None:
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert batch_amounts([{"input_ids": ids, "attention_mask": mask}]) == (8, 2, 5)
    assert batch_amounts([{"input_ids": ids}, {"input_ids": ids}]) == (20, 4, 5)
    assert batch_amounts([[{"prompt": "a"}, {"prompt": "b"}]]) == (None, 2, None)
    assert batch_amounts([(torch.zeros(16, 3), torch.zeros(16, 1))]) == (None, 16, None)
    assert batch_amounts([{"x": 1}]) == (None, None, None)


def test_importing_trainguard_and_the_hook_imports_no_framework() -> None:
    code = (
        "import sys, trainguard, trainguard.integrations.auto as a; a.install(); "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'lightning', 'pytorch_lightning', 'trl', 'torch')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_auto_hook_patches_the_trainer_on_import() -> None:
    pytest.importorskip("transformers")
    code = (
        "import trainguard.integrations.auto as a; a.install(); "
        "from transformers import Trainer; assert Trainer.__init__._trainguard"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=300)


def test_report_overhead_adds_the_metrics_flushers_cpu_since_the_last_report() -> None:
    from types import SimpleNamespace

    from trainguard.integrations.common import SafeTelemetry, report_overhead

    reported: list[float] = []
    ckpt = SimpleNamespace(record_step_overhead=reported.append)
    tg = SimpleNamespace(flush_cpu_s=0.0)
    t = SafeTelemetry(tg, "hf")  # type: ignore[arg-type]
    report_overhead(t, ckpt, 0.001)
    tg.flush_cpu_s = 0.0005  # the flusher wrote records since
    report_overhead(t, ckpt, 0.001)
    report_overhead(t, ckpt, 0.002)
    assert reported == pytest.approx([0.001, 0.0015, 0.002])
    ckpt = SimpleNamespace(record_step_overhead=lambda s: 1 / 0)  # never into training
    report_overhead(t, ckpt, 0.001)
    assert t.failures == 1
