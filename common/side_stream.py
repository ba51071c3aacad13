"""A side CUDA stream for copies that overlap the compute stream, ordered by events.

    side = SideStream(device)
    with side.after_compute() as compute:   # the copy sees the compute stream's work so far
        side.keep(index)                    # a tensor made on the compute stream, read here
        ... copies ...
        side.done(compute)                  # the compute stream's next work waits for them

No host synchronisation anywhere: the loop goes on while the copies run. Off CUDA (the
CPU) the block runs as is, in order, and the calls are no-ops.
"""

from __future__ import annotations

import torch


class SideStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ctx: object | None = None
        self._compute: torch.cuda.Stream | None = None

    def after_compute(self) -> SideStream:
        return self

    def __enter__(self) -> torch.cuda.Stream | None:
        if self.stream is None:
            return None
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()  # type: ignore[attr-defined]
        return compute

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)  # type: ignore[attr-defined]
            self._ctx = None

    def keep(self, t: torch.Tensor) -> None:
        """A tensor made on the compute stream and read on the side stream: its memory is
        not reused before the side stream is done with it."""
        if self.stream is not None:
            t.record_stream(self.stream)

    def done(self, compute: torch.cuda.Stream | None) -> None:
        """The compute stream waits for this block's copies (on the GPU, not the host)."""
        if self.stream is not None and compute is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            compute.wait_event(event)
