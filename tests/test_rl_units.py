"""trainguard.rl logic without processes: the prompt ledger, its audit, the weight store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainguard.rl import ConsumedLog, PromptLedger, RolloutConfig, WeightStore, audit


def test_ledger_order_is_a_permutation_per_epoch_and_deterministic() -> None:
    a, b = PromptLedger(10, seed=3), PromptLedger(10, seed=3)
    first = [a.prompt_id(g) for g in range(10)]
    assert sorted(first) == list(range(10))
    assert first == [b.prompt_id(g) for g in range(10)]
    assert [a.prompt_id(g) for g in range(10, 20)] != first  # another epoch, another order


def test_ledger_resume_reissues_pending_without_rollout_and_keeps_buffered() -> None:
    led = PromptLedger(8, seed=0)
    step0 = led.take(3)
    led.commit(step0)
    inflight = led.take(3)  # async: handed out, not trained
    led.put(inflight[0], {"text": "7 7"})
    saved = led.state_dict()
    back = PromptLedger(8, seed=0)
    back.load_state_dict(saved)
    assert back.trained == 3
    assert back.buffer == {inflight[0]: {"text": "7 7"}}
    assert back.reissued() == inflight[1:]
    assert back.take(3) == [*inflight[1:], 6]  # lost generations first, then new positions
    back.commit([*inflight, 6])
    assert back.pending == [] and back.buffer == {}
    with pytest.raises(ValueError, match="already trained"):
        back.commit([0])


def test_ledger_refuses_another_data_set() -> None:
    saved = PromptLedger(8, seed=0).state_dict()
    with pytest.raises(ValueError, match="same data set and seed"):
        PromptLedger(9, seed=0).load_state_dict(saved)


def test_audit_counts_skips_duplicates_and_keeps_the_last_record_of_a_step(tmp_path: Path) -> None:
    led = PromptLedger(4, seed=0)
    log = ConsumedLog(tmp_path / "c.jsonl")
    for step, pos in enumerate([[0, 1], [2, 3], [4, 5]]):
        log.append(step, pos, [led.prompt_id(p) for p in pos])
    log.append(1, [2, 3], [led.prompt_id(p) for p in (2, 3)])  # step 1 re-run after a restore
    good = audit(log, 4)
    assert (good.steps, good.trained, good.skipped, good.duplicated) == (3, 6, 0, 0)
    assert good.sequence == [led.prompt_id(g) for g in range(6)]
    log.append(2, [5, 5], [led.prompt_id(5)] * 2)  # a duplicate and a hole (4)
    bad = audit(log, 4)
    assert (bad.skipped, bad.duplicated) == (1, 1)
    log.append(4, [8, 9], [0, 1])
    with pytest.raises(ValueError, match="no record for steps"):
        audit(log, 4)


def test_weight_store_publishes_atomically_and_prunes(tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "w", keep=2)
    assert store.current() is None
    with pytest.raises(FileNotFoundError):
        store.load()
    for v in range(4):
        store.publish(v, {"a": torch.full((3,), float(v)), "b": torch.ones(2)})
    cur = store.current()
    assert cur is not None and cur.version == 3
    version, sd = store.load()
    assert version == 3 and sd["a"].tolist() == [3.0] * 3
    assert store.load(2)[1]["a"][0] == 2.0
    with pytest.raises(FileNotFoundError):
        store.load(1)  # pruned: keep=2
    (tmp_path / "w" / "current.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a weight-store pointer"):
        store.current()


def test_rollout_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="at least 1"):
        RolloutConfig(max_attempts=0)
