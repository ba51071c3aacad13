#!/usr/bin/env bash
# Download, once, the wheels bench/device_check.sh needs on the GPU machine (no network there)
# into .device/ (ignored by git): .device/nixl (phase d, and e's KV transfer) and
# .device/serving (pyzmq and the HTTP stack, phase e). Then add up what one `run` call would
# carry and fail unless it fits in LIMIT (60 MiB, under the tool's 64 MiB).
#
# NIXL: the nixl-cu13 wheel (56.05 MiB) and the `nixl` meta-package go to .device/downloads
# (a cache that is never carried) and bench/nixl_trim.py writes trimmed copies of them to
# .device/nixl: only what the UCX backend loads (libnixl, the UCX plugin, libucp/uct/ucs/ucm,
# the cma and CUDA modules, and the libraries they link, gRPC among them), 11.42 MiB. Measured
# with 1.5.1: repo 2.9 MiB + .device/nixl 11.42 MiB + .device/serving 8.87 MiB = 23.2 MiB
# (the raw wheel made it 67.8 MiB, over the tool's 64).
#
# What the GPU image lacks (KINDS.md "Python packages already there"): NIXL, pyzmq and the
# serving stack below. It already has anyio, h11, click, idna, annotated-doc, uvloop, httpx,
# msgpack, prometheus-client, safetensors, transformers, tokenizers. fastapi imports
# opentelemetry-api at import time; pydantic 2.14 wants typing-extensions >= 4.16, newer than
# the image's may be, so both travel too. gguf stays behind: pdserve imports it only to
# convert a .gguf model, and the check makes HF checkpoints. xgrammar (structured output,
# with its apache-tvm-ffi) is imported by every node's sampler. The versions are the ones this
# repo's CPU venv runs its tests with.
#
# Usage: bash bench/device_prepare.sh [--force | --check]   (uses .venv's pip when there is one)
#   --force  empty .device first (the download cache too)
#   --check  download and trim nothing: add up what is in .device now, against the limit
# DEVICE_ROOT (the tree that travels; default this repo) and DEVICE_LIMIT_MIB (default 60)
# override the two for tests.
set -euo pipefail

ROOT="${DEVICE_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LIMIT=$(( ${DEVICE_LIMIT_MIB:-60} * 1024 * 1024 ))
CARRIED=(.device/nixl .device/serving)  # never .device itself: .device/downloads stays here
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3

NIXL_WHEELS=(nixl-cu13==1.5.1 nixl==1.5.1)
SERVING_WHEELS=(
  pyzmq==27.3.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 httptools==0.9.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  sniffio==1.3.1 opentelemetry-api==1.45.2 typing-extensions==4.16.0
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
)

MODE="${1:-}"
case "$MODE" in
  ""|--check) ;;
  --force) rm -rf "$ROOT/.device" ;;
  *) echo "device_prepare.sh: unknown flag $MODE (--force or --check)" >&2; exit 2 ;;
esac

wheel_of() {  # the wheel of this name==version in the folder, if there
  local dir="$1" name="${2%%==*}" version="${2##*==}"
  compgen -G "$dir/${name//-/_}-${version}-*.whl" | head -n 1
}

fetch() {  # fetch DIR SPEC...
  local dir="$1" spec
  shift
  mkdir -p "$dir"
  for spec in "$@"; do
    if [ -n "$(wheel_of "$dir" "$spec")" ]; then continue; fi
    echo "downloading $spec"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$dir" "$spec" 2>&1 | grep -v "Location 'file:" || true
    [ -n "$(wheel_of "$dir" "$spec")" ] || { echo "device_prepare: $spec did not download" >&2; exit 1; }
  done
}

if [ "$MODE" != --check ]; then
  fetch "$ROOT/.device/downloads" "${NIXL_WHEELS[@]}"
  raw=()
  for spec in "${NIXL_WHEELS[@]}"; do raw+=("$(wheel_of "$ROOT/.device/downloads" "$spec")"); done
  # Trimmed into a fresh folder, then swapped in: .device/nixl never holds a raw wheel.
  rm -rf "$ROOT/.device/nixl.part"
  "$PY" "$BENCH/nixl_trim.py" --out "$ROOT/.device/nixl.part" "${raw[@]}"
  rm -rf "$ROOT/.device/nixl"
  mv "$ROOT/.device/nixl.part" "$ROOT/.device/nixl"
  fetch "$ROOT/.device/serving" "${SERVING_WHEELS[@]}"
fi

# What travels: tracked files + untracked files git does not ignore + the carried folders.
cd "$ROOT"
sum() { awk '{s += $1} END {print s + 0}'; }
repo=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } \
  | xargs -0 -r stat -c %s 2>/dev/null | sum)
bytes_of() { if [ -d "$1" ]; then find "$1" -type f -printf '%s\n' | sum; else echo 0; fi; }
mib() { awk -v b="$1" 'BEGIN {printf "%6.2f MiB", b / 1048576}'; }

echo
for dir in "${CARRIED[@]}"; do
  [ -d "$dir" ] || { echo "  $dir: missing (run bash bench/device_prepare.sh)"; continue; }
  find "$dir" -type f -printf '%s %p\n' | sort -k2 | awk '{printf "  %8.2f MiB  %s\n", $1 / 1048576, $2}'
done
echo
total=$repo
echo "repo (tracked + untracked, not ignored): $(mib "$repo")"
for dir in "${CARRIED[@]}"; do
  bytes=$(bytes_of "$dir")
  total=$((total + bytes))
  printf '%-40s %s\n' "$dir:" "$(mib "$bytes")"
done
echo "one call, every phase:                   $(mib "$total") of $(mib "$LIMIT")"
if [ "$total" -gt "$LIMIT" ]; then
  echo "device_prepare: DOES NOT FIT: one call would carry $(mib "$total"), over the" \
    "$(mib "$LIMIT") limit by $(mib $((total - LIMIT))); trim what travels" \
    "(bench/nixl_trim.py, the serving list above) or split the phases over two calls" >&2
  exit 1
fi
echo "FITS in one call ($(mib $((LIMIT - total))) to spare):"
echo "  carry [\".device/nixl\", \".device/serving\"], timeout_s 480, command: bash bench/device_check.sh"
