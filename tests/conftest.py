"""Test-wide setup: the tests run several torch processes side by side on few cores."""

import os
import sys

import pytest

# Spinning OpenMP threads of one process starve the others (see common/launcher.py);
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

# Test helpers (tests/tolerance.py, tests/unit/test_model_runner.py's tiny checkpoints, tests/integration/kv_node.py)
# are imported by module name from sibling directories.
for sub in ("", "unit", "integration"):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), sub).rstrip(os.sep)
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """A torch device the test runs on: cpu always, cuda where torch sees a GPU."""
    import torch

    if request.param == "cuda" and not _cuda_present():
        pytest.skip("torch sees no CUDA device")
    return torch.device(request.param)

