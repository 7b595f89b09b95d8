#!/usr/bin/env bash
# The GPU checks (issue 13) in one command on a machine with one CUDA GPU; every file goes to OUT.
#
#   bash benchmarks/scripts/gpu_checks.sh OUT [env] [gpu-tests] [train] [hf] [suite]
#
#   env        GPU, driver, CUDA, torch/transformers/accelerate versions -> OUT/versions.json
#   gpu-tests  pytest -m gpu                                             -> OUT/pytest_gpu.txt
#   train      a ~78M-non-embedding proxy, 300 bf16 steps, ours vs a plain PyTorch loop, MFU
#              against the bf16 matmul peak measured in the same command -> OUT/training_speed.jsonl
#   hf         HF backend: LLaMA-3.2-1B's shape vs the 1B rehearsal's chosen shape at 4096 in /
#              1024 out, batch 1,16,64,128, beside the analytic roofline for this GPU
#                                                                        -> OUT/hf.jsonl, OUT/analytic.jsonl
#   suite      the whole test suite on this machine (pytest-xdist)       -> OUT/pytest_suite.txt
# Run from the repository root with archsearch importable (pip install -e . or PYTHONPATH=.).
set -uo pipefail
OUT=${1:?usage: gpu_checks.sh OUT [env] [gpu-tests] [train] [hf] [suite]}
shift
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-env gpu-tests train hf}
status=0
for step in $steps; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    env)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.csv"
      $PY - "$OUT/versions.json" <<'PY' || status=1
import json, platform, sys, importlib.metadata as md
import torch
names = ["torch", "transformers", "accelerate", "optuna", "vllm", "numpy", "peft", "lm_eval"]
v = {}
for n in names:
    try:
        v[n] = md.version(n)
    except md.PackageNotFoundError:
        v[n] = None
info = {"gpu": torch.cuda.get_device_name(0), "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(), "capability": list(torch.cuda.get_device_capability(0)),
        "python": platform.python_version(), "packages": v}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
PY
      ;;
    gpu-tests)
      $PY -m pytest -m gpu -rA -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.txt" || status=1
      ;;
    train)
      $PY -m archsearch.benchmarks.scripts.bench_training_speed --layers 12 --hidden 768 --head-dim 64 \
        --seq-len 1024 --batch 32 --steps 300 --repeats 1 --vocab 8192 \
        --out "$OUT/training_speed.jsonl" || status=1
      ;;
    hf)
      for arch in "--preset llama-3.2-1b" "--arch results/examples/paper-1b-rehearsal/chosen"; do
        # shellcheck disable=SC2086  # two words on purpose
        $PY -m archsearch bench --backend hf $arch --input-len 4096 --output-len 1024 \
          --batch-sizes 1,16,64,128 --repeats 1 --warmup 0 --timeout 900 --out "$OUT/hf.jsonl" || status=1
        # shellcheck disable=SC2086
        $PY -m archsearch bench --backend analytic $arch --input-len 4096 --output-len 1024 \
          --batch-sizes 1,16,64,128 --out "$OUT/analytic.jsonl" || status=1
      done
      ;;
    suite)
      $PY -m pytest -q -n "${WORKERS:-12}" -rfEs --timeout 600 tests 2>&1 | tee "$OUT/pytest_suite.txt" || status=1
      ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
