"""common/gc_policy.py: start-up frozen, the young generation's threshold raised; 0 leaves it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from common import gc_policy


@pytest.fixture
def restore_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restore_gc")
def test_settle_freezes_what_is_alive_and_raises_the_young_threshold() -> None:
    gc.unfreeze()
    gen1, gen2 = gc.get_threshold()[1:]
    built_at_startup = [[i] for i in range(100)]
    gc_policy.settle(12_345)
    assert gc.get_threshold() == (12_345, gen1, gen2)
    assert gc.get_freeze_count() >= len(built_at_startup)


@pytest.mark.usefixtures("restore_gc")
def test_zero_leaves_pythons_policy() -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    gc_policy.settle(0)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
