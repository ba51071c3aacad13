"""The decode node's replies of one step, held per gateway and sent as one ReplyBatch each."""

from __future__ import annotations

from typing import Final, Self

from common import messages as msg
from common.ipc import MAX_FRAME_BYTES, PushPool

# A batch that encodes larger goes as two (its halves, and so on): a PULL socket takes at
# most MAX_FRAME_BYTES, and a few large PromptLogprobs in one step could reach it together.
MAX_BATCH_BYTES: Final = MAX_FRAME_BYTES // 4


class Outbox:
    """Holds gateway replies per endpoint, in the order sent, until ``flush``; owns ``push``.

    ``send`` is PushPool's, so an Outbox goes wherever a PushPool did (RequestFailures).
    ``flush`` sends each endpoint one frame: a ReplyBatch of what it holds, or a lone
    message as itself. A message that is no GatewayReply is not held: the endpoint's
    replies go first, then it, so each endpoint still receives in the order of ``send``.
    """

    def __init__(self, push: PushPool, *, max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        self.push = push
        self.max_batch_bytes = max_batch_bytes
        self._held: dict[str, list[msg.GatewayReply]] = {}

    @property
    def num_held(self) -> int:
        """Replies waiting for the next flush, over every endpoint."""
        return sum(len(replies) for replies in self._held.values())

    def send(self, endpoint: str, message: msg.Message) -> bool:
        """Hold ``message`` for ``endpoint`` until ``flush``: True (a full queue shows then)."""
        if not isinstance(message, msg.GatewayReply):
            self._flush_to(endpoint)
            return self.push.send(endpoint, message)
        self._held.setdefault(endpoint, []).append(message)
        return True

    def flush(self) -> list[str]:
        """Send everything held; the endpoints whose send queue was full (what they held
        is dropped, as with PushPool.send's False)."""
        refused = [endpoint for endpoint in list(self._held) if not self._flush_to(endpoint)]
        return refused

    def close(self) -> None:
        """Flush, then close the sockets (unsent frames are dropped, as PushPool.close)."""
        self.flush()
        self.push.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _flush_to(self, endpoint: str) -> bool:
        replies = self._held.pop(endpoint, None)
        return replies is None or self._send(endpoint, replies)

    def _send(self, endpoint: str, replies: list[msg.GatewayReply]) -> bool:
        if len(replies) == 1:
            return self.push.send(endpoint, replies[0])
        data = msg.encode(msg.ReplyBatch(messages=replies))
        if len(data) <= self.max_batch_bytes:
            return self.push.send_encoded(endpoint, data)
        half = len(replies) // 2  # the second half only after the first: no gap in the order
        return self._send(endpoint, replies[:half]) and self._send(endpoint, replies[half:])
