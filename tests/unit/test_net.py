"""free_port: a port a server can bind, that no outgoing connection can take before it does."""

import socket

from kubemoe import net
from kubemoe.net import _ephemeral_low, free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < _ephemeral_low() for p in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("0.0.0.0", port))  # every interface, as the expert function's TCP lanes bind


def test_a_port_in_use_is_skipped(monkeypatch):
    taken, free = net.free_port(), net.free_port()
    net._given.difference_update({taken, free})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", taken))
        busy.listen()
        draws = iter([taken, free])
        monkeypatch.setattr(net.random, "randrange", lambda a, b: next(draws))
        assert net.free_port() == free
