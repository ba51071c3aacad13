"""Fixtures of the prefill loop tests: the tiny Llama on disk and a harness around it."""

from __future__ import annotations

import pytest

from tests.support.prefill_harness import Harness


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.unit.common.model.test_model_runner import _save_tiny

    path = tmp_path_factory.mktemp("tiny")
    _save_tiny(path, "llama")
    return path


@pytest.fixture
def h(model_dir):
    harness = Harness(model_dir)
    yield harness
    harness.close()
