#!/usr/bin/env bash
# The prepared GPU check: pdserve on one H200 in at most 7 minutes, every phase under its own
# timeout, results as JSON lines ($OUT/device_check.jsonl, else --out) and a table at the end.
#
#   a  equivalence with transformers (float32, bfloat16): tiny Llama/Qwen2, SmolLM2-135M and
#      Llama-3.2-1B shapes, random weights made on the machine; full prompt, 3 chunks, batched
#      decode (teacher-forced)
#   b  decode ms per step at batch 1/32/128, 512-token contexts (1B, SmolLM2; bf16): CUDA
#      graphs on and off, transformers, and the HBM bound from a copy measured in the run
#   c  prefill tokens/s at 1k/4k/16k (1B, bf16) vs transformers and an 8192^3 bf16 matmul
#   d  NIXL VRAM to VRAM between two processes (2048 SmolLM2 bf16 pages), every byte checked,
#      GB/s vs a device-to-device copy
#   e  one completion (max_tokens 16) through gateway, prefill and decode processes
#
# Run on the GPU machine (one call; see bench/device_prepare.sh for the sizes), with the
# `run` tool:
#     carry:     [".device"]
#     timeout_s: 480
#     command:   bash bench/device_check.sh
# Everything comes back in $OUT (device_check.jsonl, device_check.log). If the tree ever
# outgrows 64 MiB with every wheel, split it in two calls (device_prepare.sh says so):
#     carry [".device/serving"], command: bash bench/device_check.sh --phases a,b,c,e
#     carry [".device/nixl"],    command: bash bench/device_check.sh --phases d
# (without NIXL, phase e runs over the fake backend and says that no KV bytes moved).
# Before that, once, on a machine with PyPI: bash bench/device_prepare.sh
#
# Here, on the CPU (tiny shapes, NIXL over DRAM; the smoke test of this script):
#     bash bench/device_check.sh --cpu --out /tmp/device_check.jsonl
#
# Flags: --cpu, --phases a,b,c,d,e, --out FILE, --work DIR (checkpoints; default a temp dir);
# $PYTHON picks the interpreter (default: .venv/bin/python if there, else python3).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CPU=0
PHASES="a,b,c,d,e"
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
mkdir -p "$(dirname "$RESULTS")"
: > "$RESULTS"
LOG="${OUT:+$OUT/device_check.log}"
LOG="${LOG:-$WORK/device_check.log}"
exec > >(tee -a "$LOG") 2>&1

since() { awk -v now="$(date +%s.%N)" -v t0="$1" 'BEGIN {printf "%.2f", now - t0}'; }

PY="${PYTHON:-python3}"  # the GPU image's python3 holds torch; here the repo's venv does
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; fi

# Seconds per phase (sum 385 on the GPU, with the install well inside 7 minutes).
if [ "$CPU" = 1 ]; then
  declare -A LIMIT=([a]=60 [b]=45 [c]=45 [d]=60 [e]=90)
else
  declare -A LIMIT=([a]=105 [b]=95 [c]=60 [d]=50 [e]=75)
fi

start_all=$(date +%s.%N)
SITE=""
wheels=$(compgen -G "$ROOT/.device/*/*.whl" || true)
if [ "$CPU" = 0 ] && [ -n "$wheels" ]; then
  SITE=/tmp/pdserve-site
  t0=$(date +%s.%N)
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" $wheels || echo "device_check.sh: installing the carried wheels failed"
  echo "installed $(echo "$wheels" | wc -l) carried wheels in $(since "$t0") s"
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MODE=()
if [ "$CPU" = 1 ]; then MODE=(--cpu); fi
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
