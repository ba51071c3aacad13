"""Decode through common.model.cuda_graph's static buffers: buckets, padding rows on a scratch
page, the page-major table, one input copy. On the CPU the buffers run the model eagerly; on
CUDA (the `device` fixture) the same steps replay captured graphs."""

from __future__ import annotations

import pytest
import torch

from common.kv_pool import pages_needed
from common.model.cuda_graph import DecodeGraphs, bucket_for, graph_buckets
from common.model.runner import ExtendRequest, ModelRunner
from tests.unit.common.model.test_model_runner import _prompt, _save_tiny

PAGE = 4


def test_buckets_are_small_powers_then_every_sixteen():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_for(3, graph_buckets(48)) == 4
    assert bucket_for(17, graph_buckets(48)) == 32
    assert bucket_for(49, graph_buckets(48)) is None
    with pytest.raises(ValueError):
        graph_buckets(0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_graphs")
    _save_tiny(path, "qwen2")
    return path


def _runner(model_dir, device, **kw) -> ModelRunner:
    return ModelRunner.from_path(
        str(model_dir),
        progress=False,
        page_size=PAGE,
        num_pages=96,
        device=str(device),
        dtype="float32",
        **kw,
    )


def test_padded_bucket_steps_match_plain_decode_and_touch_no_live_page(model_dir, device):
    """Three sequences run in bucket 4: the padding row writes only the scratch page, every
    other page holds exactly what plain decode writes, and the logits agree."""
    plain = _runner(model_dir, device, disable_cuda_graph=True)
    graphed = _runner(model_dir, device)
    if graphed.graphs is None:  # the CPU: the same buffers, run eagerly
        graphed.graphs = DecodeGraphs(graphed, 8, capture=False)
    graphs = graphed.graphs
    prompts = [_prompt(n, 40 + n) for n in (5, 13, 2)]
    tables = []
    for r in (plain, graphed):
        pages = [r.pool.allocator.allocate(pages_needed(len(p) + 6, PAGE)) for p in prompts]
        r.extend([ExtendRequest(p, 0, pg) for p, pg in zip(prompts, pages)])
        tables.append(pages)
    tokens = [p[-1] for p in prompts]
    lens = [len(p) + 1 for p in prompts]
    for _ in range(5):
        want = plain.decode(tokens, lens, tables[0])
        got = graphed.decode(tokens, lens, tables[1]).clone()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = want.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    live = sorted(set(sum(tables[1], [])))
    assert graphs.scratch_page not in live
    # the scratch page is the pool's spare: no request can hold it, no page is used for it
    assert graphs.scratch_page == graphed.pool.num_pages
    assert graphed.pool.allocator.num_used_pages == len(live)
    for p_plain, p_graph in zip(sum(tables[0], []), sum(tables[1], [])):
        torch.testing.assert_close(
            graphed.pool.buffer[p_graph], plain.pool.buffer[p_plain], atol=1e-5, rtol=0
        )
    if device.type == "cuda":
        assert graphs.is_captured and set(graphs.graphs) == set(graphs.buckets)


def test_a_batch_past_the_largest_bucket_runs_without_a_graph(model_dir, device):
    runner = _runner(model_dir, device, cuda_graph_max_bs=2)
    if runner.graphs is None:
        runner.graphs = DecodeGraphs(runner, 2, capture=False)
    prompts = [_prompt(3, 60 + i) for i in range(3)]
    pages = [runner.pool.allocator.allocate(2) for _ in prompts]
    runner.extend([ExtendRequest(p, 0, pg) for p, pg in zip(prompts, pages)])
    assert not runner.graphs.fits(3, [4, 4, 4])
    logits = runner.decode([1, 2, 3], [4, 4, 4], pages)
    assert logits.shape == (3, runner.spec.vocab_size) and torch.isfinite(logits).all()


def test_one_page_table_column_prefix_is_all_a_step_copies(model_dir):
    """The table is page-major: a batch using 2 pages per row copies 3 * max_bs + 2 * max_bs
    numbers, however wide the graph's table is."""
    runner = _runner(model_dir, torch.device("cpu"))
    graphs = DecodeGraphs(runner, 4, capture=False)
    pages = runner.pool.allocator.allocate(2)
    runner.extend([ExtendRequest(_prompt(6, 1), 0, pages)])
    used = graphs._fill([5], [7], [pages], 1)
    assert used == 2 and graphs.width >= 2
    table = graphs.host[3 * graphs.max_bs :].view(graphs.width, graphs.max_bs)
    assert table[:2, 0].tolist() == [p * runner.layer_stride for p in pages]
    assert graphs.host[2 * graphs.max_bs].item() == (
        pages[1] * runner.layer_stride * PAGE + (7 - 1) % PAGE
    )
