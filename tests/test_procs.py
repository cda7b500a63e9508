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


_CHILD = """
import sys, time
sys.stdin.readline()                                  # the sampler is running
block = bytearray(64 * 2**20)
block[::4096] = b"x" * len(block[::4096])             # touch every page
print("held", flush=True)
sys.stdin.readline()
del block
print("freed", flush=True)
sys.stdin.readline()                                  # stay alive until the high-water mark is read
"""


def _child():
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _say(proc, expect=None):
    proc.stdin.write("go\n")
    proc.stdin.flush()
    if expect:
        assert proc.stdout.readline().strip() == expect


def test_rss_samples_see_memory_taken_inside_the_block():
    """A fresh process, so the reading is not the test runner's own high-water mark or its other children."""
    proc = _child()
    try:
        with procs.rss_samples(proc.pid, every_s=0.01) as seen:
            _say(proc, "held")
            while len(seen) < 3:
                pass
            _say(proc, "freed")
        assert seen[0] + 32 * 2**20 < max(seen[1:-1])  # a sample taken while the block was held
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_peak_a_sample_missed_is_the_high_water_mark():
    proc = _child()
    try:
        with procs.rss_samples(proc.pid, every_s=60) as seen:  # no sample while the block is held
            _say(proc, "held")
            _say(proc, "freed")
        assert len(seen) == 2
        assert seen[0] + 32 * 2**20 < seen[-1]
    finally:
        proc.kill()
        proc.wait(timeout=10)


class _Stub:
    """Stands in for a started server: records its stop."""

    def __init__(self, stopped: list[str], name: str):
        self.stopped, self.name = stopped, name

    def stop(self) -> None:
        self.stopped.append(self.name)


def test_a_group_stops_a_scoped_blocks_servers_at_its_end_and_the_rest_at_close(tmp_path):
    stopped: list[str] = []
    with procs.ProcGroup("model", tmp_path) as group:
        group.started(_Stub(stopped, "kept"))
        try:
            with group.scoped():
                group.started(_Stub(stopped, "a"))
                group.started(_Stub(stopped, "b"))
                raise RuntimeError("a lab failing half-way")
        except RuntimeError:
            pass
        assert stopped == ["b", "a"]  # on failure too, the latest first
    assert stopped == ["b", "a", "kept"]
    assert procs.ProcGroup("m", tmp_path).kv_secret != group.kv_secret  # each group signs with its own


def test_scrape_gives_each_servers_rise_and_their_sum(monkeypatch):
    seen = iter([{"x": 1.0, "y": 5.0}, {"x": 2.0}, {"x": 4.0, "y": 6.0}, {"x": 2.5}])
    monkeypatch.setattr(procs, "metrics", lambda url: next(seen))
    with procs.Scrape(["a", "b"]) as scraped:
        pass
    assert scraped.rises("x") == [3.0, 0.5] and scraped.rise("x") == 3.5
    assert scraped.rises("y") == [1.0, 0.0]  # a sample a server lacks counts as 0


def test_exit_on_sigterm_runs_finally_blocks_and_exits_143():
    """A benchmark or server stopped by SIGTERM stops what it started: its `finally` blocks run."""
    import subprocess
    import sys

    code = (
        "import os, signal\nfrom inferd.procs import exit_on_sigterm\nexit_on_sigterm()\n"
        "try:\n    os.kill(os.getpid(), signal.SIGTERM)\n    signal.pause()\nfinally:\n    print('stopped')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143 and done.stdout.strip() == "stopped"
