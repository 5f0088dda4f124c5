"""What every framework integration shares: the step heartbeat split over a framework's
begin/end hooks, the mapping of a framework's metric names onto the metric contract, and
logging that never raises into training."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any

from trainguard.core.contracts.metrics import METRICS
from trainguard.core.handles import CheckpointHandle
from trainguard.worker.api import RESERVED_LOG_KEYS, TrainGuard

__all__ = [
    "MetricMapper",
    "SafeTelemetry",
    "StepBeat",
    "batch_amounts",
    "flops_per_token",
    "report_overhead",
]

logger = logging.getLogger(__name__)

CONTRACT_KEYS = frozenset(k for spec in METRICS for k in spec.log_keys)
"""Every ``tg.log`` key the metric contract reads."""

_ALIASES = {
    # transformers / TRL
    "learning_rate": "lr",
    "completions/mean_length": "response_length",
    "completions/max_length": "response_length_max",
    "clip_ratio/region_mean": "clip_ratio",
    "reward_mean": "reward",
    "rewards/mean": "reward",
    "rewards/std": "reward_std",
    "objective/kl": "kl",
    "objective/entropy": "entropy",
    "policy/clipfrac": "clip_fraction",
}
_PREFIXES = ("train/", "train_", "train.")
_SUFFIXES = ("_step", "/step")
_RESERVED = RESERVED_LOG_KEYS | {"step"}
_MAX_CACHED = 256
"""Sets of metric names whose mapping is kept (a framework logs a few; more are recomputed)."""


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


_PLAIN = frozenset({float, int, str})


def _scalar(value: Any) -> float | int | str | None:
    """A loggable value: numbers (NaN and inf kept), strings, one-element tensors and arrays;
    None for what has no single value (None, multi-element tensors)."""
    if type(value) in _PLAIN:
        plain: float | int | str = value
        return plain
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    try:
        n = numel() if callable(numel) else numel
        if n == 1 and hasattr(value, "item"):
            item: float | int | str = value.item()
            return item
    except Exception:
        return None
    return None


class MetricMapper:
    """Framework metric names → ``tg.log`` keys: the contract's key where one exists (``loss``,
    ``lr``, ``grad_norm``, ``reward``, ``kl``, ``clip_ratio``, ``response_length``...), the
    framework's own name otherwise. ``strip_prefixes``: also match user names such as
    ``train_loss`` / ``train/loss_step`` (Lightning, where metric names are the user's)."""

    def __init__(self, *, strip_prefixes: bool = False) -> None:
        self.strip_prefixes = strip_prefixes
        self.dropped = 0
        """Values without a single value (None, multi-element tensors): not logged."""
        self._cache: dict[str, str] = {}
        self._orders: dict[tuple[str, ...], list[str]] = {}
        self._keys: dict[tuple[str, ...], frozenset[str]] = {}

    def keys_of(self, names: tuple[str, ...]) -> frozenset[str]:
        """The ``tg.log`` keys the names map onto (cached per set of names)."""
        hit = self._keys.get(names)
        if hit is None:
            if len(self._keys) >= _MAX_CACHED:
                self._keys.clear()
            hit = self._keys[names] = frozenset(self.key(n) for n in names)
        return hit

    def key(self, name: str) -> str:
        hit = self._cache.get(name)
        if hit is None:
            hit = self._cache[name] = self._key(name)
        return hit

    def _key(self, name: str) -> str:
        if name in CONTRACT_KEYS:
            return name
        if name in _ALIASES:
            return _ALIASES[name]
        if self.strip_prefixes:
            base = name
            for p in _PREFIXES:
                if base.startswith(p):
                    base = base[len(p) :]
                    break
            for s in _SUFFIXES:
                if base.endswith(s):
                    base = base[: -len(s)]
                    break
            if base.startswith("lr-") or base == "lr":  # LearningRateMonitor: lr-AdamW
                return "lr"
            if base in CONTRACT_KEYS:
                return base
            if base in _ALIASES:
                return _ALIASES[base]
        if name in _RESERVED:
            return f"{name}_value"
        return name

    def map(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        flat: Mapping[str, Any] = metrics
        if any(type(v) not in _PLAIN and isinstance(v, Mapping) for v in metrics.values()):
            nested: dict[str, Any] = {}
            _flatten("", metrics, nested)
            flat = nested
        names = tuple(flat)
        order = self._orders.get(names)
        if order is None:
            if len(self._orders) >= _MAX_CACHED:
                self._orders.clear()
            # names that are the contract's own come first: they keep it, an alias met later
            # (train_loss next to loss) keeps its own name
            order = self._orders[names] = sorted(names, key=lambda n: self.key(n) != n)
        out: dict[str, Any] = {}
        for name in order:
            raw = flat[name]
            value = _scalar(raw)
            if value is None:
                self.dropped += 1
                continue
            key = self.key(name)
            if key in out:
                key = name if name not in _RESERVED else f"{name}_value"
            out[key] = value
        return out


class SafeTelemetry:
    """``tg.log`` and the heartbeat's calls made safe: a failure is logged (once) and counted,
    never raised into training."""

    def __init__(self, tg: TrainGuard, framework: str) -> None:
        self.tg = tg
        self.framework = framework
        self.failures = 0
        self.flush_cpu_seen = 0.0

    def failed(self, what: str) -> None:
        self.failures += 1
        if self.failures == 1:
            logger.warning(
                "trainguard %s integration: %s failed", self.framework, what, exc_info=True
            )
        else:
            logger.debug(
                "trainguard %s integration: %s failed", self.framework, what, exc_info=True
            )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not metrics:
            return
        try:
            self.tg.log(step=step, **metrics)
        except Exception:
            self.failed("logging metrics")


class StepBeat:
    """``with tg.step(...)`` split over a framework's step-begin and step-end hooks (a
    framework never gives trainguard the body of a step): the progress heartbeat, the step
    record (time, tokens, FLOPs) and ``tg.step_num`` following the framework's step."""

    def __init__(self, telemetry: SafeTelemetry) -> None:
        self._t = telemetry
        self._cm: Any = None
        self.step: int | None = None

    @property
    def open(self) -> bool:
        return self._cm is not None

    def begin(
        self,
        step: int,
        *,
        tokens: int | None = None,
        samples: int | None = None,
        flops: float | None = None,
    ) -> None:
        if self._cm is not None:
            self.end()
        try:
            cm = self._t.tg.step(step, tokens=tokens, samples=samples, flops=flops)
            cm.__enter__()
        except Exception:
            self._t.failed("the step heartbeat")
            return
        self._cm, self.step = cm, step

    def end(self) -> None:
        cm, self._cm = self._cm, None
        if cm is None:
            return
        try:
            cm.__exit__(None, None, None)
        except Exception:
            self._t.failed("the step record")


def report_overhead(
    telemetry: SafeTelemetry | None, ckpt: CheckpointHandle | None, seconds: float
) -> None:
    """Tell the checkpoint manager what one step cost: the time it spent in the integration's
    hooks and the metrics flusher's CPU time since the last report (its memory-tier cadence
    keeps the whole of it within its budget)."""
    if ckpt is None:
        return
    try:
        if telemetry is not None:
            flushed = telemetry.tg.flush_cpu_s
            seconds += max(flushed - telemetry.flush_cpu_seen, 0.0)
            telemetry.flush_cpu_seen = flushed
        ckpt.record_step_overhead(seconds)
    except Exception:
        if telemetry is not None:
            telemetry.failed("reporting the hooks' time")


def _tensor_of(batch: Any, name: str) -> Any:
    if isinstance(batch, Mapping):
        return batch.get(name)
    return getattr(batch, name, None)


def batch_amounts(batches: list[Any]) -> tuple[int | None, int | None, int | None]:
    """(tokens, samples, sequence length) of one step's micro-batches where they can be read:
    ``input_ids`` (counted through ``attention_mask`` when there is one), else the length of
    a list of examples or the first dimension of a batch's (first) tensor."""
    tokens = samples = seq = None
    for b in batches:
        ids = _tensor_of(b, "input_ids")
        if ids is not None and hasattr(ids, "shape") and len(ids.shape) >= 1:
            mask = _tensor_of(b, "attention_mask")
            n = int(mask.sum()) if mask is not None and hasattr(mask, "sum") else int(ids.numel())
            tokens = (tokens or 0) + n
            samples = (samples or 0) + int(ids.shape[0])
            seq = int(ids.shape[-1])
            continue
        first = b[0] if isinstance(b, (list, tuple)) and b else b
        if hasattr(first, "shape") and len(first.shape) >= 1:
            samples = (samples or 0) + int(first.shape[0])
        elif isinstance(b, (list, tuple)):
            samples = (samples or 0) + len(b)
    return tokens, samples, seq


def _config_value(config: Any, *names: str) -> int | None:
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def flops_per_token(model: Any, seq_len: int | None = None) -> float | None:
    """Training FLOPs per token from the model and its config: 6 N (N parameters) plus the
    attention term 12 L H S (layers, hidden size, sequence length) when the config has them."""
    try:
        params: Iterator[Any] = model.parameters()
        n = sum(p.numel() for p in params)
    except Exception:
        return None
    if n <= 0:
        return None
    flops = 6.0 * n
    config = getattr(model, "config", None)
    if config is not None and seq_len:
        layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
        hidden = _config_value(config, "hidden_size", "n_embd", "d_model")
        if layers and hidden:
            flops += 12.0 * layers * hidden * seq_len
    return flops if math.isfinite(flops) else None
