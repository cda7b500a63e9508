"""inferd.procs: a port is handed out once per process, so servers started one after another never share one
while the first is still loading; a process's memory is sampled with its peak."""

from __future__ import annotations

import socket

from inferd import procs


class _FakeSocket:
    """A socket whose bind(("host", 0)) gets the next port of a fixed list, as an OS may offer one twice."""

    offers: list[int] = []

    def __init__(self, *args):
        self.port = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, address):
        self.port = _FakeSocket.offers.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_a_port_the_os_offers_twice_is_handed_out_once(monkeypatch):
    monkeypatch.setattr(procs, "_HANDED_OUT", set())
    monkeypatch.setattr(procs.socket, "socket", _FakeSocket)
    _FakeSocket.offers = [50001, 50001, 50002]
    assert procs.free_port() == 50001
    assert procs.free_port() == 50002  # the OS offered 50001 again: a server may still be loading on it


def test_real_ports_are_free_and_distinct():
    ports = [procs.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free now


def test_rss_samples_see_memory_taken_inside_the_block():
    import os

    before = procs.rss(os.getpid())
    with procs.rss_samples(os.getpid(), every_s=0.01) as seen:
        block = bytearray(64 * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page
        while len(seen) < 3:
            pass
    assert seen[0] <= before + 32 * 2**20 < max(seen)  # the peak, the kernel's high-water mark included
    del block
