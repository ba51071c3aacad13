"""Decode through common.model.cuda_graph's static buffers: buckets, padding rows on the
spare page, one input copy of three columns, slots' pages written where they change. On the
CPU the buffers run the model eagerly; on CUDA (the `device` fixture) the same steps replay
captured graphs."""

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
    """Three sequences run in bucket 4: the padding row writes only the spare page, every
    other page holds exactly what plain decode writes, and the logits agree."""
    plain = _runner(model_dir, device, disable_cuda_graph=True)
    graphed = _runner(model_dir, device)
    if device.type != "cuda":  # the CPU: the same buffers and padding, run eagerly
        graphed.graphs = DecodeGraphs(graphed, 8, capture=False, pad=True)
    graphs = graphed.graphs
    prompts = [_prompt(n, 40 + n) for n in (5, 13, 2)]
    tables = []
    for r in (plain, graphed):
        pages = [r.pool.allocator.allocate(pages_needed(len(p) + 6, PAGE)) for p in prompts]
        r.extend([ExtendRequest(p, 0, pg) for p, pg in zip(prompts, pages)])
        tables.append(pages)
    spare = graphed.pool.spare_page_ids[0]
    before_spare = graphed.pool.buffer[spare].clone()
    tokens = [p[-1] for p in prompts]
    lens = [len(p) + 1 for p in prompts]
    for _ in range(5):
        want = plain.decode(tokens, lens, tables[0])
        got = graphed.decode(tokens, lens, tables[1]).clone()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = want.argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    live = sorted(set(sum(tables[1], [])))
    # the padding row's page is the pool's spare: no request can hold it, no page is used
    assert spare not in live and spare == graphed.pool.num_pages
    assert not torch.equal(graphed.pool.buffer[spare], before_spare)  # the padding ran
    assert graphed.pool.allocator.num_used_pages == len(live)
    for p_plain, p_graph in zip(sum(tables[0], []), sum(tables[1], [])):
        torch.testing.assert_close(
            graphed.pool.buffer[p_graph], plain.pool.buffer[p_plain], atol=1e-5, rtol=0
        )
    if device.type == "cuda":
        assert graphs.is_captured and set(graphs.graphs) == set(graphs.buckets)


def test_a_batch_past_the_largest_bucket_runs_without_a_graph(model_dir, device):
    runner = _runner(model_dir, device, cuda_graph_max_bs=2)
    prompts = [_prompt(3, 60 + i) for i in range(3)]
    pages = [runner.pool.allocator.allocate(2) for _ in prompts]
    runner.extend([ExtendRequest(p, 0, pg) for p, pg in zip(prompts, pages)])
    logits = runner.decode([1, 2, 3], [4, 4, 4], pages)
    assert bucket_for(3, runner.graphs.buckets) is None
    assert logits.shape == (3, runner.spec.vocab_size) and torch.isfinite(logits).all()


def test_a_step_copies_three_columns_and_only_the_pages_that_changed(model_dir):
    """Per step the host writes each row's slot, length and split count; a slot's pages
    reach the device once, and a step that adds no page stages none."""
    runner = _runner(model_dir, torch.device("cpu"))
    slots = runner.slots
    pages = runner.pool.allocator.allocate(3)
    runner.extend([ExtendRequest(_prompt(6, 1), 0, pages[:2])])
    slot = slots.acquire()
    slots.set_pages(slot, pages[:2])
    slots.set_token(slot, 5)
    assert len(slots._page_index) == 2 and slots.has_staged
    runner.decode_slots([slot], [7])
    assert not slots.has_staged and slots.row(slot) == pages[:2]
    slots.set_pages(slot, pages[:2])  # nothing new
    assert not slots.has_staged
    slots.set_pages(slot, pages)  # one page more: one entry staged
    assert slots._page_index == [slot * slots.max_pages + 2]
    runner.decode_slots([slot], [9])
    host = runner.graphs._host[1].numpy()  # the second step's buffer
    n = runner.graphs.num_rows
    assert (host[0], host[n], host[2 * n]) == (slot, 9, 1)
    assert slots.row(slot) == pages
    assert runner.graphs.static.numel() == 3 * n  # the whole step's input: one copy
