"""What the Triton kernels compile on a GPU (common.model.triton_launch, kernel_variants):
the walk on meta tensors finds a fixed, small set per model configuration; a real run in
Triton's interpreter launches exactly that set however its lengths and batches vary; and
the keys are Triton's own (its binder, for a CUDA target, in a process without the
interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are defined: before Triton loads
pytest.importorskip("triton")

from common.kv_pool import pages_needed  # noqa: E402
from common.model.kernel_variants import serving_variants  # noqa: E402
from common.model.runner import ExtendRequest, ModelRunner  # noqa: E402
from common.model.spec import ModelSpec  # noqa: E402
from common.model.triton_launch import Variant, recording  # noqa: E402
from tests.unit.common.model.test_model_runner import _save_tiny  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
PAGE = 4
# one compile per kernel and configuration; the residual add with RMSNorm twice (the first
# norm has no residual to add)
PER_CONFIGURATION = {
    "_decode_kernel": 1,
    "_merge_splits_kernel": 1,
    "_extend_kernel": 1,
    "_rope_store_kernel": 1,
    "_silu_mul_kernel": 1,
    "_add_rms_norm_kernel": 2,
}
SMOLLM2 = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_a_configuration_compiles_each_kernel_once(dtype, page_size):
    """30 layers, every graph bucket, extends of 1 to 300 tokens with and without a prefix:
    layers, strides, lengths and batch sizes specialise nothing (before, every layer
    index that is 1 or a multiple of 16, every split count and every table width did)."""
    spec = ModelSpec.from_hf_config(SMOLLM2)
    variants = serving_variants(spec, dtype, page_size, graph_max_bs=128)
    assert Counter(v.kernel for v in variants) == PER_CONFIGURATION
    assert {v.dtype_class for v in variants} == {
        {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    }


def test_a_prefill_node_compiles_the_decode_kernel_only_for_its_warm_up_step():
    """One short decode step at warm-up: one split, no merge."""
    spec = ModelSpec.from_hf_config(SMOLLM2)
    got = Counter(v.kernel for v in serving_variants(spec, "bfloat16", 16, decodes=False))
    assert got == {k: n for k, n in PER_CONFIGURATION.items() if k != "_merge_splits_kernel"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_variants")
    _save_tiny(path, "llama")
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run: the CPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_real_run_launches_exactly_the_walked_variants(tiny, dtype):
    """The tiny model in Triton's interpreter: odd and even lengths, batches of 1 to 9,
    prefixes, every layer. The GPU keys of its launches are the walk's."""
    runner = ModelRunner.from_path(
        str(tiny),
        progress=False,
        page_size=PAGE,
        num_pages=96,
        dtype=dtype,
        attention_backend="triton",
        cuda_graph_max_bs=8,
    )
    # the products as on a GPU (F.linear, row-major outputs): the CPU's weight-major one
    # hands silu a transposed view, a variant no GPU launches
    runner.model.chooser = runner.model.head_chooser = None
    alloc = runner.pool.allocator
    with recording() as recorder:
        for n, prefix in [(1, 0), (3, 0), (13, 0), (6, 5), (2, 9)]:
            pages = alloc.allocate(pages_needed(n + prefix + 1, PAGE))
            runner.extend([ExtendRequest([5] * n, prefix, pages)])
            alloc.free(pages)
        tables = [alloc.allocate(7) for _ in range(9)]
        for bs in (1, 3, 9):
            lens = [1 + 2 * i + bs for i in range(bs)]
            runner.decode([7] * bs, lens, tables[:bs])
        for t in tables:
            alloc.free(t)
    walked = set(serving_variants(runner.spec, dtype, PAGE, graph_max_bs=8))
    ran = set(recorder.variants)
    assert ran <= walked, [(v.kernel, v.aligned, v.constexprs) for v in ran - walked]
    # short sequences split once: the merge runs only in graphs (always) and long steps
    assert {v.kernel for v in walked - ran} <= {"_merge_splits_kernel"}
    assert len(ran) >= len(walked) - 1


_TRITONS_OWN = r"""
import json, sys, torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import create_function_from_signature
from common.model import triton_attention as ta, triton_extend as te, triton_fused as tf
from common.model.triton_launch import variant_of
from common.model.kernel_variants import ast_source
from triton.compiler import ASTSource

backend = CUDABackend(GPUTarget("cuda", 90, 32))
out = []

def check(fn, args, meta):
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*args, **meta)
    _, signature, constexprs, attrs = fn._pack_args(backend, meta, bound, spec, options)
    names = fn.arg_names
    theirs = dict(
        signature=signature,
        constexprs={names[k[0]]: v for k, v in constexprs.items()},
        attrs=[(names[k[0]], a) for k, a in attrs.items()],  # in order: the key hashes it
    )
    v = variant_of(fn, args, meta)
    ours = dict(
        signature=dict(v.signature),
        constexprs=dict(v.constexprs),
        attrs=[(n, backend.parse_attr(a)) for n, a in v.attrs],
    )
    # the compile source ahead of time hashes as the JIT's does: its disk cache entry is hit
    jit_hash = ASTSource(fn, signature, constexprs, attrs).hash()
    ours["source_hash"] = ast_source(v).hash() == jit_hash
    theirs["source_hash"] = True
    out.append([fn.__name__, theirs == ours, str(theirs), str(ours)])

bf = torch.bfloat16
for layer, stride, rows in [(0, 3072, 1), (1, 3072, 16), (17, 3076, 33)]:
    pool = torch.empty(8, 16 * 3 * 64, dtype=bf)
    table = torch.zeros(4, 8, dtype=torch.int32)
    slots = torch.zeros(rows, dtype=torch.long)
    q = torch.empty(rows, 12, 64, dtype=bf)[:, :9]
    out_t = torch.empty(rows, 9 * 64, dtype=bf)
    part = torch.empty(rows, 9, 32, 64), torch.empty(rows, 9, 32)
    check(ta._decode_kernel,
          (pool, stride, table, table.stride(0), slots, slots, slots.int(), q, q.stride(0),
           q.stride(1), out_t, out_t.stride(0), *part, layer, 0.125),
          dict(GROUPS=3, KV_HEADS=3, HEAD_DIM=64, PAGE=16, LAYER_ROWS=60, MAX_SPLITS=32,
               BLOCK_G=16, BLOCK_N=64, BLOCK_D=64, PREC="tf32", UPCAST=False, num_warps=4,
               num_stages=2))
    gu = torch.empty(rows, 2 * 1536, dtype=bf)
    act = torch.empty(rows, 1536, dtype=bf)
    check(tf._silu_mul_kernel, (gu, gu.stride(0), gu.stride(1), act, act.stride(0), 1, rows, 1536),
          dict(BLOCK_R=4, BLOCK_C=256, EMULATE=False, num_warps=4))
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checked where the keys are derived")
def test_the_recorded_keys_are_tritons_own():
    """Triton's binder and argument packing for a CUDA target (what its JIT keys its cache
    by) against triton_launch.variant_of, for layers 0, 1 and 17, strides divisible by 16
    or not, 1 / 16 / 33 rows: the same signature, constexprs and attributes, and the
    ahead-of-time source hashes as the JIT's (kernel_variants.precompile fills the cache
    the launch reads)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _TRITONS_OWN],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 6
    for name, same, theirs, ours in rows:
        assert same, (name, theirs, ours)


def test_a_variant_travels_as_json():
    spec = ModelSpec.from_hf_config(SMOLLM2)
    for v in serving_variants(spec, "bfloat16", 16):
        assert Variant.from_json(json.loads(json.dumps(v.to_json()))) == v
