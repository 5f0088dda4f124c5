"""GPU check of trainguard.health on a real GPU: `trainguard health --json` (NVML) + GEMM probe.

Runs with plain ``python3 bench/gpu_health.py`` from the repository root (CUDA torch,
nvidia-ml-py and prometheus_client installed; opentelemetry not needed). Steps:

1. ``python3 -m trainguard health --json --expect-gpus <visible GPUs>`` as a subprocess: the
   node report through NVML (dcgm-exporter/DCGM report "not present" unless running), exit code.
2. NVML probe cost: 20 in-process probes of the NVML source, median milliseconds.
3. The compute probe: bf16 GEMMs (8192 and 16384) for ~2 s each; TFLOP/s against the
   989e12 dense bf16 peak of H100 SXM/H200 (and against the peak trainguard looks up by name).

Prints one JSON line at the end (finishes in well under 3 minutes).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

H200_PEAK = 989e12


def cli_report(expect: int | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "trainguard", "health", "--json"]
    if expect:
        cmd += ["--expect-gpus", str(expect)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    out: dict = {"exit_code": p.returncode, "wall_s": round(time.monotonic() - t0, 3)}
    try:
        out["report"] = json.loads(p.stdout)
    except json.JSONDecodeError:
        out["stdout"] = p.stdout[-3000:]
        out["stderr"] = p.stderr[-3000:]
    return out


def nvml_cost() -> dict:
    from trainguard.core.config.health import HealthConfig
    from trainguard.health.nvml import NvmlSource
    from trainguard.health.policy import Policy

    src = NvmlSource(HealthConfig(), Policy())
    first = src.probe()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        r = src.probe()
        times.append(time.perf_counter() - t0)
    src.close()
    return {
        "present": first.present,
        "status": r.status.value,
        "error": r.error,
        "probe_ms_median": round(statistics.median(times) * 1e3, 3),
        "first_probe_ms": round(first.duration_s * 1e3, 3),
    }


def gemm() -> dict:
    import torch

    from trainguard.health.compute import gemm_probe

    if not torch.cuda.is_available():
        return {"error": "CUDA not available"}
    out = {}
    for n in (8192, 16384):
        try:
            r = gemm_probe(2.0, device="cuda", size=n)
        except Exception as e:  # e.g. out of memory
            out[str(n)] = {"error": repr(e)}
            continue
        d = r.to_dict()
        d["fraction_of_989e12"] = round(r.flops_per_s / H200_PEAK, 4)
        out[str(n)] = d
    # the preflight's own default (8192, ~1 s)
    r = gemm_probe(1.0)
    out["preflight_default"] = dict(
        r.to_dict(), fraction_of_989e12=round(r.flops_per_s / H200_PEAK, 4)
    )
    return out


def main() -> None:
    t0 = time.monotonic()
    result: dict = {"python": sys.version.split()[0]}
    try:
        import torch

        result["torch"] = torch.__version__
        expect = torch.cuda.device_count() if torch.cuda.is_available() else None
        result["cuda_devices"] = expect
    except ImportError:
        expect = None
    result["cli"] = cli_report(expect)
    print(json.dumps(result["cli"], indent=2), flush=True)
    try:
        result["nvml"] = nvml_cost()
    except Exception as e:
        result["nvml"] = {"error": repr(e)}
    try:
        result["gemm"] = gemm()
    except Exception as e:
        result["gemm"] = {"error": repr(e)}
    best = max(
        (v.get("tflops", 0) for v in result["gemm"].values() if isinstance(v, dict)), default=0
    )
    result["best_bf16_tflops"] = best
    result["best_fraction_of_989e12"] = round(best * 1e12 / H200_PEAK, 4) if best else None
    result["wall_s"] = round(time.monotonic() - t0, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
