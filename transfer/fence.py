"""Write fencing: a writer posts into a room's pages only while its lease is provably alive.

Why no write lands in pages its room no longer owns (L = the receiver's lease, m = the
margin, MARGIN_FRACTION * L):

  1. The writer (prefill) sends LeaseRenew(seq, rooms) at t0 on its own monotonic clock
     and remembers t0 under seq (RenewalLog). Nothing in the message is trusted for time.
  2. The receiver (decode), at its time g, grants each room it still holds for this
     writer: it promises not to reuse the room's pages before g + L on its clock.
     g comes after t0 in real time (the message had to travel).
  3. On the grant (seq echoed), the writer sets its fence to t0 + L - m and posts a write
     only while its clock reads less than that. Past it, writes wait for a new grant (a
     receiver that still holds the room gives one; one that let it go answers
     "released"), and the room fails after a lease without one. t0 + L - m precedes
     g + L whenever the two clocks' rates differ by less than m / L = 10% (real
     monotonic clocks differ by parts per million), so
     every write is posted before the receiver may reuse the pages, however slow the
     network and however long a renewal sat in a queue.
  4. A paused writer (SIGSTOP, a GC or VM stall) reads its clock when it resumes: the
     fence has passed and it posts nothing; renewals queued before the pause date from
     before it and extend nothing.
  5. The receiver frees a failed room's pages only after (a) the writer's explicit stop
     (TransferFailed, sent once none of its writes is in flight), or (b) its clock passes
     the room's last grant + L. Before the first grant the writer cannot write at all, so
     a room never granted is free at once.

Worst-case timings: a dead writer's room is failed L after its last renewal was received
(renewals go every L/3) and its pages are reusable at that same moment (its last grant +
L); a live writer whose renewals stop being granted stops posting at most L - m after its
last granted renewal was sent.

The window that remains: a pause between the writer's fence check and the end of its
post call. With UCX over cma or shared memory the bytes move inside that call (a short
one, growing with the pages written); over a network the bytes may move after it. A
write posted within the fence but landing after it could reach reused pages, so the
writer reads its clock again right after every post, and watches writes still in flight
when the fence passes: any write that may have landed past the fence is reported to the
receiver (LateWrite), which fails every other request now holding those pages (500)
instead of letting it stream wrong tokens. Only a writer killed between such a late
landing and its report goes unreported.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

MARGIN_FRACTION = 0.1


def writer_fence_end(sent_at: float, lease_s: float) -> float:
    """The last instant (writer's clock) a write may be posted.

    That is, under a grant of a renewal sent at `sent_at`.
    """
    return sent_at + lease_s * (1.0 - MARGIN_FRACTION)


def receiver_fence_end(granted_at: float, lease_s: float) -> float:
    """The first instant (receiver's clock) the pages of a room may be reused.

    That is, of a room granted at `granted_at`.
    """
    return granted_at + lease_s


@dataclass
class Fence:
    """One room's fence: on the writer the end of its right to post, on the receiver the
    start of its right to reuse the pages. Only moves forward."""

    until: float = -math.inf

    @property
    def has_grant(self) -> bool:
        return self.until > -math.inf

    def is_open(self, now: float) -> bool:
        return now < self.until

    def extend(self, until: float) -> None:
        self.until = max(self.until, until)


class RenewalLog:
    """Writer side: when each LeaseRenew was sent (by seq), so a grant is dated by our clock.

    Written by the lease thread, read by the loop thread; entries older than `horizon_s`
    can no longer open a fence and are dropped.
    """

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._sent: dict[int, tuple[float, str]] = {}
        self._next_seq = 1
        self._lock = threading.Lock()

    def record(self, endpoint: str, now: float) -> int:
        """A renewal to `endpoint` is about to be sent at `now`; its seq."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._sent[seq] = (now, endpoint)
            if len(self._sent) > 64:
                for old in [s for s, (t, _) in self._sent.items() if now - t > self.horizon_s]:
                    del self._sent[old]
            return seq

    def take(self, seq: int, endpoint: str) -> float | None:
        """The send time of renewal `seq` if it went to `endpoint` (each seq opens one grant)."""
        with self._lock:
            entry = self._sent.get(seq)
            if entry is None or entry[1] != endpoint:
                return None
            del self._sent[seq]
            return entry[0]
