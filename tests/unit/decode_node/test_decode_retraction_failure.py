"""A retraction that runs out of memory on the real decode loop: that request alone fails with
a retryable 503 and its pages are freed; the others finish (decode_node/scheduler.py's
_retract catching RetractionFailed, and --host-pool-size read into the retracted queue)."""

from __future__ import annotations

import decode_node.host_pool as host_pool
from common import messages as msg
from tests.support.decode_harness import PD, SMALL_CHUNKS, assert_all_free, prompt


def test_a_retraction_out_of_memory_fails_that_request_retryably(model_dir, monkeypatch):
    h = PD(
        model_dir,
        decode_pages=14,
        num_reserved_decode_tokens=4,
        host_pool_size=1e-9,  # GB: one page
        prefill_cfg=SMALL_CHUNKS,
    )

    def no_host_memory(*args, **kwargs):  # a pageable copy: the host pool (one page) is full
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(host_pool, "PinnedPages", no_host_memory)
    try:
        assert h.decode.retracted_queue.host.allocator.num_pages == 1
        rids = [f"r{k}" for k in range(4)]
        for k, rid in enumerate(rids):
            h.submit(rid, 400 + k, prompt(17, 60 + k), max_new_tokens=16)
        h.run_until(lambda: h.done(*rids), timeout=60)
        ends = [h.result(rid) for rid in rids]
        failed = [e for e in ends if isinstance(e, msg.ReqFailed)]
        assert failed and all(e.status == 503 and e.retryable for e in failed)
        assert any(isinstance(e, msg.ReqFinished) for e in ends)
        assert h.decode.stats.num_retractions == 0
        assert_all_free(h)
    finally:
        h.close()
