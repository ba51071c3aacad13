"""tests/support/ports.py, which the integration tests and the benches take ports from."""

from __future__ import annotations

import socket

from tests.support import ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    got = [ports.free_port() for _ in range(40)]
    assert len(set(got)) == 40
    low = ports.ephemeral_low()
    assert all(10000 <= p < low for p in got)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[-1]))  # still free to take


def test_a_port_someone_listens_on_is_never_handed_out(monkeypatch):
    with socket.socket() as busy, socket.socket() as other:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        other.bind(("127.0.0.1", 0))
        taken, free = busy.getsockname()[1], other.getsockname()[1]
        other.close()
        draws = iter([taken, taken, free])
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65535)
        monkeypatch.setattr(ports._RNG, "randrange", lambda lo, hi: next(draws))
        assert ports.free_port() == free


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    def no_draw(lo, hi):
        raise AssertionError("drew below a range that leaves no room")

    monkeypatch.setattr(ports, "ephemeral_low", lambda: 10500)
    monkeypatch.setattr(ports._RNG, "randrange", no_draw)
    assert ports.free_port() > 0
