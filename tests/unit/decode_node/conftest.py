"""Fixtures of the decode loop tests: the tiny Llama on disk and a reference runner."""

from __future__ import annotations

import pytest
import torch

from common.model.runner import ModelRunner

PAGE = 4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # Tiny matmuls on a shared 2-core machine: extra threads only spin against each other.
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.unit.common.model.test_model_runner import _save_tiny

    path = tmp_path_factory.mktemp("tiny")
    _save_tiny(path, "llama")
    return path


@pytest.fixture(scope="module")
def ref(model_dir):
    return ModelRunner.from_path(str(model_dir), progress=False, page_size=PAGE, num_pages=64)


@pytest.fixture
def pd(model_dir):
    """A prefill and a decode loop in this process (tests/support/decode_harness.py)."""
    from tests.support.decode_harness import PD

    h = PD(model_dir)
    yield h
    h.close()
