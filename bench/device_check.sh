#!/usr/bin/env bash
# The prepared GPU check: pdserve on one H100 (or H200) in at most 8 minutes, every phase
# under its own timeout, results as JSON lines ($OUT/device_check.jsonl, else --out) and a
# table at the end. Each phase first compiles the Triton kernels it will launch, at once and
# in parallel (the variants a meta-tensor walk of its runners finds), and reports what it
# compiled; with --cpu it checks those counts against their budget instead.
#
#   a  equivalence with transformers: tiny Llama/Qwen2 in float32 and bfloat16, SmolLM2-135M
#      and Llama-3.2-1B shapes in bfloat16, random weights made on the machine; full prompt,
#      3 chunks, batched decode (teacher-forced)
#   b  decode ms per step at batch 1/32/128, 512-token contexts (1B, SmolLM2; bf16): CUDA
#      graphs on and off, transformers, and the HBM bound from a copy measured in the run
#   c  prefill tokens/s at 1k/4k/16k (1B, bf16) vs transformers and an 8192^3 bf16 matmul
#   d  NIXL VRAM to VRAM between two processes (2048 SmolLM2 bf16 pages), every byte checked,
#      GB/s vs a device-to-device copy
#   e  one completion (max_tokens 16) through gateway, prefill and decode processes
#
# Run on the GPU machine in one call (bench/device_prepare.sh checks that it fits: 23.2 MiB
# of the 60 MiB it allows, NIXL trimmed to 11.4 MiB), with the `run` tool:
#     carry:     [".device/nixl", ".device/serving"]   (not .device: .device/downloads is raw)
#     timeout_s: 480
#     command:   bash bench/device_check.sh
# Everything comes back in $OUT (device_check.jsonl, device_check.log). Should the tree ever
# outgrow that (device_prepare.sh then fails and says so), split it in two calls:
#     carry [".device/serving"], command: bash bench/device_check.sh --phases a,b,c,e
#     carry [".device/nixl"],    command: bash bench/device_check.sh --phases d
# (without NIXL, phase e runs over the fake backend and says that no KV bytes moved).
# Before that, once, on a machine with PyPI: bash bench/device_prepare.sh
#
# Here, on the CPU (tiny shapes, NIXL over DRAM; the smoke test of this script):
#     bash bench/device_check.sh --cpu --out /tmp/device_check.jsonl
#
# Flags: --cpu, --phases a,b,c,d,e, --out FILE, --work DIR (checkpoints; default a temp dir),
# --rerun FILE (only the phases that failed, timed out or never ended in an earlier run's
# results: copy its device_check.jsonl into the carried .device/ and pass that path);
# $PYTHON picks the interpreter (default: .venv/bin/python if there, else python3).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CPU=0
PHASES="a,b,c,d,e"
RERUN=""
RESULTS=""
WORK=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=1 ;;
    --phases) PHASES="$2"; shift ;;
    --phases=*) PHASES="${1#*=}" ;;
    --out) RESULTS="$2"; shift ;;
    --out=*) RESULTS="${1#*=}" ;;
    --work) WORK="$2"; shift ;;
    --work=*) WORK="${1#*=}" ;;
    --rerun) RERUN="$2"; shift ;;
    --rerun=*) RERUN="${1#*=}" ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "device_check.sh: unknown flag $1" >&2; exit 2 ;;
  esac
  shift
done

if [ -z "$WORK" ]; then WORK="$(mktemp -d /tmp/pdserve-device-check.XXXXXX)"; fi
mkdir -p "$WORK"
if [ -z "$RESULTS" ]; then
  if [ -n "${OUT:-}" ]; then RESULTS="$OUT/device_check.jsonl"; else RESULTS="$WORK/device_check.jsonl"; fi
fi
PY="${PYTHON:-python3}"  # the GPU image's python3 holds torch; here the repo's venv does
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; fi
if [ -n "$RERUN" ]; then  # the phases an earlier run's results say failed, only
  PHASES="$("$PY" "$ROOT/bench/device_check.py" --failed-phases "$RERUN")"
  if [ -z "$PHASES" ]; then echo "device check: every phase of $RERUN passed"; exit 0; fi
fi
mkdir -p "$(dirname "$RESULTS")"
: > "$RESULTS"
LOG="${OUT:+$OUT/device_check.log}"
LOG="${LOG:-$WORK/device_check.log}"
exec > >(tee -a "$LOG") 2>&1

since() { awk -v now="$(date +%s.%N)" -v t0="$1" 'BEGIN {printf "%.2f", now - t0}'; }

# Seconds per phase (sum 390 on the GPU: with the install and the table, under 8 minutes;
# every phase compiles its Triton kernels first, in parallel, and counts what it compiled).
if [ "$CPU" = 1 ]; then
  declare -A LIMIT=([a]=60 [b]=45 [c]=45 [d]=60 [e]=90)
else
  declare -A LIMIT=([a]=100 [b]=90 [c]=60 [d]=45 [e]=95)
fi

start_all=$(date +%s.%N)
SITE=""
# The carried folders only: .device/nixl holds NIXL trimmed by bench/nixl_trim.py (wheels
# pip installs like any other), .device/downloads the raw downloads, which never travel.
wheels=$(compgen -G "$ROOT/.device/nixl/*.whl"; compgen -G "$ROOT/.device/serving/*.whl")
if [ "$CPU" = 0 ] && [ -n "$wheels" ]; then
  SITE=/tmp/pdserve-site
  t0=$(date +%s.%N)
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" $wheels || echo "device_check.sh: installing the carried wheels failed"
  echo "installed $(echo "$wheels" | wc -l) carried wheels in $(since "$t0") s"
  # UCX's transport modules (cma, cuda_copy, cuda_ipc) from the trimmed NIXL, not from
  # UCX's build-time folder; an operator's UCX_MODULE_DIR wins.
  ucx_modules=$(compgen -G "$SITE/nixl_cu*.libs/ucx" | head -n 1)
  if [ -n "$ucx_modules" ] && [ -z "${UCX_MODULE_DIR:-}" ]; then
    export UCX_MODULE_DIR="$ucx_modules"
    echo "UCX_MODULE_DIR=$UCX_MODULE_DIR"
  fi
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODE=()
if [ "$CPU" = 1 ]; then MODE=(--cpu); fi
# one Triton cache for every phase: a kernel a phase compiled is not compiled again
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$WORK/triton-cache}"
printf '{"phase": "-", "kind": "plan", "phases": "%s"}\n' "$PHASES" >> "$RESULTS"
echo "device check: phases $PHASES, $([ "$CPU" = 1 ] && echo cpu || echo gpu), results $RESULTS"

for phase in ${PHASES//,/ }; do
  limit="${LIMIT[$phase]:-}"
  if [ -z "$limit" ]; then echo "device_check.sh: unknown phase $phase" >&2; continue; fi
  t0=$(date +%s.%N)
  echo "--- phase $phase (limit $limit s)"
  # timeout signals its whole process group (the phase's children too), SIGKILL 5 s later
  timeout -k 5 "$limit" "$PY" "$ROOT/bench/device_check.py" --phase "$phase" ${MODE[@]+"${MODE[@]}"} \
    --out "$RESULTS" --work "$WORK" --deadline "$((limit - 8))" &
  pid=$!
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null || true  # anything the phase left behind
  elapsed=$(since "$t0")
  timed_out=false
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then timed_out=true; fi
  printf '{"phase": "%s", "kind": "phase_end", "rc": %d, "timed_out": %s, "elapsed_s": %.2f}\n' \
    "$phase" "$rc" "$timed_out" "$elapsed" | tee -a "$RESULTS"
done

"$PY" "$ROOT/bench/device_check.py" --table "$RESULTS"
status=$?
echo "total $(since "$start_all") s"
exit "$status"
