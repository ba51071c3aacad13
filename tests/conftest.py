"""Test-wide setup: the tests run several torch processes side by side on few cores."""

import os

import pytest

# Spinning OpenMP threads of one process starve the others (see common/launch/launcher.py);
# set before any test module imports torch, inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU the Triton kernels (the CUDA path) run in Triton's interpreter. Triton reads
# this once, when it is first imported, and transformers imports it when it is installed: so
# here, before any test module loads.
if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """A torch device the test runs on: cpu always, cuda where torch sees a GPU."""
    import torch

    if request.param == "cuda" and not _cuda_present():
        pytest.skip("torch sees no CUDA device")
    return torch.device(request.param)
