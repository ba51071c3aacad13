"""Whether the device work that filled some KV pages has finished: what a KV write waits on.

On the CPU a forward returns when its work is done. On CUDA it returns when the kernels are
queued: a write posted then may let UCX read pages the kernels are still writing. The model
runner records an event after each forward (`record_work_done`), and a KVSender posts the
pages that forward filled only once the event's `query()` says the work completed; nothing
blocks the loop meanwhile (KVManager.poll tries again).
"""

from __future__ import annotations

from typing import Protocol

import torch


class WorkDone(Protocol):
    """Work queued on a device up to some point; torch.cuda.Event has this shape."""

    def query(self) -> bool:
        """True once all of that work has completed."""
        ...

    def synchronize(self) -> None:
        """Block until all of that work has completed."""
        ...


class Completed:
    """Work that was complete when it was recorded (the CPU runs synchronously)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


COMPLETED = Completed()


def record_work_done(device: torch.device) -> WorkDone:
    """A marker after everything queued so far on `device`'s current stream."""
    if device.type != "cuda":
        return COMPLETED
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
