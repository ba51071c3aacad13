"""Float comparisons that hold on every CPU: tolerances scaled to the compared values.

GEMMs of other shapes (a prefix-cache hit, another batch, AVX2 vs AVX-512/AMX kernels)
sum in another order, so float32 results differ by a few ulps of the largest partial
sums, not of each element: an absolute tolerance fit for values near 1 fails on values
near 15. These helpers scale the tolerance by the reference's largest magnitude.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# float32 has 24 bits of mantissa (6e-8); reductions over a few thousand terms in another
# order move results by up to ~1e-6 of their scale. 1e-5 leaves room for several layers of
# it and still fails on any real error (a wrong page or token is off by O(scale)).
FLOAT32_REL = 1e-5


def scaled_atol(reference: Any, rel: float = FLOAT32_REL) -> float:
    """An absolute tolerance: ``rel`` times the reference's largest magnitude (at least 1)."""
    ref = np.asarray(_numpy(reference), dtype=np.float64)
    scale = float(np.max(np.abs(ref))) if ref.size else 1.0
    return rel * max(1.0, scale)


def assert_close_scaled(got: Any, expected: Any, rel: float = FLOAT32_REL) -> None:
    """Elementwise |got - expected| <= rel * max(1, max |expected|)."""
    g, e = _numpy(got), _numpy(expected)
    np.testing.assert_allclose(g, e, atol=scaled_atol(e, rel), rtol=0)


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").float().numpy()
    return np.asarray(x)
