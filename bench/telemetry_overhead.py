"""Telemetry overhead on the training path.

A 20 ms step (busy wait) with 10 metrics (``tg.log``) and 1 span (``tg.span``) per step,
telemetry on vs off, in alternating blocks; medians. Also the per-step recording cost of
trainguard's worker path vs the raw OpenTelemetry SDK recording the same things in-process
(11 histogram records with attributes + 1 span through a BatchSpanProcessor).

trainguard's worker writes JSON records (the node agent turns them into OTel metrics and
spans in its own process), so the SDK cost is not paid on the training thread.

    python bench/telemetry_overhead.py [--blocks 20 --steps-per-block 10]

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
    from trainguard.runtime.worker import TrainGuard

    return TrainGuard(run_dir=run_dir)


def run_blocks(tg, blocks: int, per_block: int) -> tuple[list[float], list[float]]:  # noqa: ANN001
    on: list[float] = []
    off: list[float] = []
    values = {k: 0.5 for k in METRICS}
    for b in range(blocks):
        telemetry = b % 2 == 0
        for _ in range(per_block):
            t0 = time.perf_counter()
            if telemetry:
                with tg.step(tokens=4096, samples=8):
                    with tg.span("rollout"):
                        busy(STEP_S)
                tg.log(**values)
                on.append(time.perf_counter() - t0)
            else:
                busy(STEP_S)
                off.append(time.perf_counter() - t0)
    return on, off


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


def raw_sdk_cost_us(n: int) -> float:
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
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        s0 = time.perf_counter()
        with tracer.start_as_current_span("rollout", attributes=attrs):
            pass
        step_h.record(time.perf_counter() - s0, attrs)
        for h in hists:
            h.record(0.5, attrs)
        samples.append(time.perf_counter() - t0)
    tp.shutdown()
    mp.shutdown()
    return statistics.median(samples) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--steps-per-block", type=int, default=10)
    p.add_argument("--cost-iters", type=int, default=5000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tg = trainguard_handle(d)
        run_blocks(tg, 2, 5)  # warm-up
        on, off = run_blocks(tg, args.blocks, args.steps_per_block)
        tg_us = trainguard_cost_us(tg, args.cost_iters)
        tg.close()
    sdk_us = raw_sdk_cost_us(args.cost_iters)
    step_on, step_off = statistics.median(on), statistics.median(off)
    print(
        json.dumps(
            {
                "step_s_off": round(step_off, 6),
                "step_s_on": round(step_on, 6),
                "overhead": round(step_on / step_off - 1, 5),
                "trainguard_us_per_step": round(tg_us, 2),
                "raw_sdk_us_per_step": round(sdk_us, 2),
                "steps_on": len(on),
                "steps_off": len(off),
                "metrics_per_step": len(METRICS),
                "spans_per_step": 1,
            }
        )
    )


if __name__ == "__main__":
    main()
