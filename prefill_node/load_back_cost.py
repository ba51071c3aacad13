"""Whether a host-tier hit is worth loading: its copy against computing the same tokens.

A host tier can be slower than recomputing (SGLang issue 26305 found a file tier slower
than recompute; a small model on a fast GPU computes a page in about the time its KV
crosses the host link). The loop feeds what a load cost per page and a prefill per token,
as they happen (moving averages); a load goes ahead until both are known, and then only
while a page loads faster than it computes.
"""

from __future__ import annotations


class LoadBackCost:
    def __init__(self, page_size: int, weight: float = 0.2) -> None:
        self.page_size = page_size
        self.weight = weight  # of the newest observation in the moving averages
        self.load_s_per_page: float | None = None
        self.compute_s_per_token: float | None = None

    def observe_load(self, num_pages: int, seconds: float) -> None:
        if num_pages > 0:
            self.load_s_per_page = self._mix(self.load_s_per_page, seconds / num_pages)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            self.compute_s_per_token = self._mix(self.compute_s_per_token, seconds / num_tokens)

    @property
    def ratio(self) -> float | None:
        """Loading a page as a fraction of computing it (None: not both measured yet)."""
        if self.load_s_per_page is None or not self.compute_s_per_token:
            return None
        return self.load_s_per_page / (self.compute_s_per_token * self.page_size)

    def is_worth_loading(self) -> bool:
        ratio = self.ratio
        return ratio is None or ratio <= 1.0

    def _mix(self, average: float | None, value: float) -> float:
        return value if average is None else average + self.weight * (value - average)
