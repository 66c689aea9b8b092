"""The tests' own port picking (tests/processes.py): a port the kernel never hands to a bind of port 0,
so a server, a store or gloo of the other xdist worker cannot take it between the pick and the child's
bind."""

from __future__ import annotations

import socket

from tests.processes import _ephemeral_low, free_port


def test_a_free_port_lies_below_the_ephemeral_range_and_skips_a_taken_one():
    low = _ephemeral_low()
    assert low > 12_000  # Linux's default range starts at 32768
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", free_port()))
    held.listen()
    try:
        picks = {free_port() for _ in range(200)}
        assert all(10_000 <= p < low for p in picks)
        assert held.getsockname()[1] not in picks
        ephemeral = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ephemeral.bind(("127.0.0.1", 0))  # what gloo or a server on port 0 gets
        with ephemeral:
            assert ephemeral.getsockname()[1] >= low
    finally:
        held.close()
