"""`--device cuda:N` makes device N current before anything launches (common.model.runner.
use_device): Triton kernels, CUDA graphs, events and streams that name no device go to the
current one. Without a GPU the same calls are checked through a stand-in of torch.cuda."""

from __future__ import annotations

import inspect

import pytest
import torch

from common.model import runner as runner_module
from common.model.runner import ModelRunner, use_device


class _FakeCuda:
    """torch.cuda as use_device sees it: four devices, device 0 current."""

    def __init__(self) -> None:
        self.current = 0
        self.calls: list[torch.device] = []

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 4

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: torch.device) -> None:
        self.calls.append(device)
        self.current = torch.device(device).index


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = _FakeCuda()
    for name in ("is_available", "device_count", "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_cuda_n_becomes_the_current_device(fake_cuda):
    assert use_device("cuda:2") == torch.device("cuda", 2)
    assert fake_cuda.calls == [torch.device("cuda", 2)] and fake_cuda.current == 2


def test_plain_cuda_takes_the_current_device_and_keeps_it(fake_cuda):
    fake_cuda.current = 1
    assert use_device("cuda") == torch.device("cuda", 1)
    assert fake_cuda.current == 1


def test_a_device_torch_does_not_see_is_refused(fake_cuda):
    with pytest.raises(RuntimeError, match="sees 4 CUDA device"):
        use_device("cuda:7")
    assert fake_cuda.calls == []


def test_the_cpu_is_left_alone(fake_cuda):
    assert use_device("cpu") == torch.device("cpu") and fake_cuda.calls == []


def test_the_runner_makes_its_device_current_before_it_allocates():
    """The first thing the runner does with its device is use_device: the weights, the
    pool, the graphs and the kernels all come after."""
    source = inspect.getsource(ModelRunner.__init__)
    body = source.split('"""')[-1]
    first_device_use = body.index("self.device")
    assert body[first_device_use:].startswith("self.device = use_device(device)")
    assert runner_module.use_device is use_device


def test_events_and_streams_are_recorded_on_the_runners_device():
    """Every event the decode path records names its device's stream (never the bare
    current one, which a thread that did not set the device would get wrong)."""
    from common import sampler, side_stream, work_done
    from common.model import cuda_graph

    for module in (sampler, work_done, cuda_graph, side_stream):
        source = inspect.getsource(module)
        assert ".record()" not in source, module.__name__
