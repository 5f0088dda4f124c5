#!/usr/bin/env bash
# All GPU checks of the open issues, in one prepared run on a machine with a CUDA GPU (H200).
# Usage (repo root): bash bench/gpu_checks.sh OUTDIR
# Installs carried OpenTelemetry wheels from .whl/ if present (the GPU image lacks them).
set -u
out=${1:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch;print('torch',torch.__version__,torch.cuda.get_device_name(0))"; } 2>&1 | tee "$out/env.log"
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name: $*" | tee -a "$out/summary.log"
  timeout "$t" "$@" > "$out/$name.log" 2>&1
  echo "rc=$?" >> "$out/$name.log"
  tail -n 25 "$out/$name.log" | tee -a "$out/summary.log"
}
step health 110 python3 bench/gpu_health.py
step mfu 130 python3 bench/gpu_mfu.py
if [ -f bench/checkpoint.py ]; then
  # 8 GiB of bf16 model + Adam state, pinned (cudaHostRegister'ed shared-memory) staging, the
  # copy on a CUDA stream the optimizer step waits for; every persist mode side by side with
  # DCP's async paths; the default mode is the headline; the JSON line is the last line
  step checkpoint 540 python3 bench/checkpoint.py --device cuda --dtype bfloat16 --size-gib 8 --trials 5
  grep '^{' "$out/checkpoint.log" | tail -n 1 > "$out/checkpoint.json" || true
fi
# Real inference engines, where their packages are on the GPU machine (nothing is fetched there):
# the vLLM adapter's tests against the ordinary CUDA vllm package, and SGLang's side of the
# engine contract's mapping (docs/rl.md "SGLang").
if python3 -c "import vllm" 2>/dev/null; then
  step vllm_adapter 600 env TRAINGUARD_VLLM_PYTHON="$(command -v python3)" TRAINGUARD_REQUIRE_ENGINES=1 \
    python3 -m pytest -q -n 0 -m engines -p no:cacheprovider tests/test_engine_vllm.py
else
  echo "=== vllm_adapter: vllm is not installed on this machine; skipped" | tee -a "$out/summary.log"
fi
if python3 -c "import sglang" 2>/dev/null; then
  step sglang 600 python3 bench/sglang_check.py
else
  echo "=== sglang: sglang is not installed on this machine; skipped" | tee -a "$out/summary.log"
fi
