#!/usr/bin/env bash
# SGLang 0.5.23's code for bench/sglang_differential.py, into DIR (default /tmp/sglang):
# DIR/sglang holds the unpacked wheel (no dependency installed), DIR/deps the few pure
# modules its scheduler's import chain needs beyond this project's environment. Nothing
# of it is imported by pdserve itself. Needs the package index (PyPI).
set -euo pipefail
dir="${1:-/tmp/sglang}"
py="${PYTHON:-python}"
mkdir -p "$dir/wheel" "$dir/deps"
"$py" -m pip download --quiet --no-deps sglang==0.5.23 -d "$dir/wheel"
"$py" -m zipfile -e "$dir"/wheel/sglang-0.5.23-*.whl "$dir/sglang"
"$py" -m pip install --quiet --no-deps --target "$dir/deps" \
    orjson pybase64 pillow msgspec ipython traitlets aiohttp multidict yarl propcache \
    aiohappyeyeballs aiosignal frozenlist dill sentencepiece compressed_tensors loguru \
    partial_json_parser
echo "$dir"
