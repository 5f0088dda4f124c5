"""Telemetry overhead on the training path.

A 20 ms step (busy wait) with 10 metrics (``tg.log``) and 1 span (``tg.span``) per step,
telemetry on vs off, in alternating blocks; medians. Also the per-step recording cost of
trainguard's worker path vs the raw OpenTelemetry SDK recording the same things in-process
(11 histogram records with attributes + 1 span through a BatchSpanProcessor).

trainguard's worker writes JSON records (the node agent turns them into OTel metrics and
spans in its own process), so the SDK cost is not paid on the training thread.

    python bench/telemetry_overhead.py [--blocks 60 --steps-per-block 10]

Prints one JSON line: step_s_off, step_s_on, overhead, trainguard_us_per_step,
raw_sdk_us_per_step (and a few details).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

STEP_S = 0.020
METRICS = [f"m{i}" for i in range(10)]


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def trainguard_handle(run_dir: str):  # noqa: ANN201
    for k in list(os.environ):
        if k.startswith(("TRAINGUARD_", "TORCHELASTIC_")):
            del os.environ[k]
    from trainguard.worker.api import TrainGuard

    return TrainGuard(run_dir=run_dir)


def run_blocks(tg, sdk, blocks: int, per_block: int) -> dict[str, list[float]]:  # noqa: ANN001
    """Blocks rotate off → trainguard → raw SDK; returns step times per mode."""
    times: dict[str, list[float]] = {"off": [], "on": [], "sdk": []}
    values = {k: 0.5 for k in METRICS}
    for b in range(blocks):
        mode = ("off", "on", "sdk")[b % 3]
        for _ in range(per_block):
            t0 = time.perf_counter()
            if mode == "on":
                with tg.step(tokens=4096, samples=8):
                    with tg.span("rollout"):
                        busy(STEP_S)
                tg.log(**values)
            elif mode == "sdk":
                sdk(lambda: busy(STEP_S))
            else:
                busy(STEP_S)
            times[mode].append(time.perf_counter() - t0)
    return times


def trainguard_cost_us(tg, n: int) -> float:  # noqa: ANN001
    values = {k: 0.5 for k in METRICS}
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        with tg.step(tokens=4096, samples=8):
            with tg.span("rollout"):
                pass
        tg.log(**values)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def raw_sdk(n: int):  # noqa: ANN201
    """(per-step recorder, shutdown): 11 histogram records with attributes + 1 span."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Null(SpanExporter):
        def export(self, spans):  # noqa: ANN001, ANN201
            return SpanExportResult.SUCCESS

    mp = MeterProvider(metric_readers=[InMemoryMetricReader()])
    meter = mp.get_meter("bench")
    step_h = meter.create_histogram("step.duration", unit="s")
    hists = [meter.create_histogram(f"bench.{k}") for k in METRICS]
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(Null()))
    tracer = tp.get_tracer("bench")
    attrs = {"rank": "0", "node": "n0"}

    def record(work) -> None:  # noqa: ANN001
        s0 = time.perf_counter()
        with tracer.start_as_current_span("rollout", attributes=attrs):
            work()
        step_h.record(time.perf_counter() - s0, attrs)
        for h in hists:
            h.record(0.5, attrs)

    def shutdown() -> None:
        tp.shutdown()
        mp.shutdown()

    return record, shutdown


def raw_sdk_cost_us(sdk, n: int) -> float:  # noqa: ANN001
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        sdk(lambda: None)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", type=int, default=60)
    p.add_argument("--steps-per-block", type=int, default=10)
    p.add_argument("--cost-iters", type=int, default=5000)
    args = p.parse_args()
    sdk, sdk_shutdown = raw_sdk(args.cost_iters)
    with tempfile.TemporaryDirectory() as d:
        tg = trainguard_handle(d)
        run_blocks(tg, sdk, 3, 5)  # warm-up
        times = run_blocks(tg, sdk, args.blocks, args.steps_per_block)
        tg_us = trainguard_cost_us(tg, args.cost_iters)
        tg.close()
    sdk_us = raw_sdk_cost_us(sdk, args.cost_iters)
    sdk_shutdown()
    on, off = times["on"], times["off"]
    step_on, step_off = statistics.median(on), statistics.median(off)
    step_sdk = statistics.median(times["sdk"])
    print(
        json.dumps(
            {
                "step_s_off": round(step_off, 6),
                "step_s_on": round(step_on, 6),
                "overhead": round(step_on / step_off - 1, 5),
                "trainguard_us_per_step": round(tg_us, 2),
                "raw_sdk_us_per_step": round(sdk_us, 2),
                "step_s_raw_sdk": round(step_sdk, 6),
                "overhead_raw_sdk": round(step_sdk / step_off - 1, 5),
                "steps_on": len(on),
                "steps_off": len(off),
                "metrics_per_step": len(METRICS),
                "spans_per_step": 1,
            }
        )
    )


if __name__ == "__main__":
    main()
