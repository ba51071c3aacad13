#!/usr/bin/env bash
# Download, once, the wheels bench/device_check.sh needs on the GPU machine (no network there)
# into .device/ (ignored by git): .device/nixl (phase d, and e's KV transfer) and
# .device/serving (pyzmq and the HTTP stack, phase e). Then print what would travel against
# the 64 MiB limit of one `run` call, and whether one call holds it all.
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
# Usage: bash bench/device_prepare.sh [--force]   (uses .venv's pip when there is one)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PIP="$ROOT/.venv/bin/pip"
[ -x "$PIP" ] || PIP="python3 -m pip"
LIMIT=$((64 * 1024 * 1024))

NIXL_WHEELS=(nixl-cu13==1.5.1 nixl==1.5.1)
SERVING_WHEELS=(
  pyzmq==27.3.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 httptools==0.9.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  sniffio==1.3.1 opentelemetry-api==1.45.2 typing-extensions==4.16.0
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
)

if [ "${1:-}" = "--force" ]; then rm -rf "$ROOT/.device"; fi

have() {  # is the wheel of this name==version in the folder?
  local dir="$1" name="${2%%==*}" version="${2##*==}"
  compgen -G "$dir/${name//-/_}-${version}-*.whl" >/dev/null
}

fetch() {  # fetch DIR SPEC...
  local dir="$1" spec
  shift
  mkdir -p "$dir"
  for spec in "$@"; do
    if have "$dir" "$spec"; then continue; fi
    echo "downloading $spec"
    $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$dir" "$spec" 2>&1 | grep -v "Location 'file:" || true
    have "$dir" "$spec" || { echo "device_prepare: $spec did not download" >&2; exit 1; }
  done
}

fetch "$ROOT/.device/nixl" "${NIXL_WHEELS[@]}"
fetch "$ROOT/.device/serving" "${SERVING_WHEELS[@]}"

# What travels: tracked files + untracked files git does not ignore + the carried folders.
cd "$ROOT"
repo=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } \
  | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
bytes_of() { find "$1" -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}'; }
nixl=$(bytes_of .device/nixl)
serving=$(bytes_of .device/serving)
mib() { awk -v b="$1" 'BEGIN {printf "%6.2f MiB", b / 1048576}'; }

echo
find .device -name '*.whl' -printf '%s %p\n' | sort -k2 \
  | awk '{printf "  %8.2f MiB  %s\n", $1 / 1048576, $2}'
echo
echo "repo (tracked + untracked, not ignored): $(mib "$repo")"
echo ".device/nixl:                            $(mib "$nixl")"
echo ".device/serving:                         $(mib "$serving")"
one=$((repo + nixl + serving))
echo "one call, every phase:                   $(mib "$one") of $(mib $LIMIT)"
if [ "$one" -le "$LIMIT" ]; then
  echo "FITS in one call ($(mib $((LIMIT - one))) to spare):"
  echo "  carry [\".device\"], timeout_s 480, command: bash bench/device_check.sh"
else
  echo "DOES NOT FIT in one call: two calls"
  echo "  carry [\".device/serving\"], command: bash bench/device_check.sh --phases a,b,c,e  ($(mib $((repo + serving))))"
  echo "  carry [\".device/nixl\"],    command: bash bench/device_check.sh --phases d        ($(mib $((repo + nixl))))"
fi
