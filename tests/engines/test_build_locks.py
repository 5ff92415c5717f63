"""One compile per program per machine (engines/build_locks.py): a builder takes the shapes no
one else is building first, waits for a shape being built elsewhere only when nothing else is
left, and a lock held by a process that died holds up nobody."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from pddjax.engines.build_locks import BuildLocks, build_in_turn


def test_free_shapes_first_then_the_one_built_elsewhere(tmp_path):
    locks, other = BuildLocks(str(tmp_path), "model|cpu"), BuildLocks(str(tmp_path), "model|cpu")
    order, started = [], threading.Event()
    release = threading.Event()

    def elsewhere():  # another builder (its own open file: flock conflicts as across processes)
        with other.held((1, 1, 8, 1), wait=True):
            started.set()
            release.wait(30)

    t = threading.Thread(target=elsewhere)
    t.start()
    assert started.wait(10)
    builder = threading.Thread(target=build_in_turn, args=([(1, 1, 8, 1), (2, 2, 8, 1), (16, 1, 32, 16)], locks,
                                                           order.append))
    builder.start()
    deadline = time.monotonic() + 10
    while len(order) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == [(2, 2, 8, 1), (16, 1, 32, 16)]  # the locked one waits; the builder is not idle meanwhile
    time.sleep(0.2)
    assert len(order) == 2  # still waiting for the other builder
    release.set()
    builder.join(10)
    t.join(10)
    assert order == [(2, 2, 8, 1), (16, 1, 32, 16), (1, 1, 8, 1)]


def test_another_program_is_not_held_up(tmp_path):
    mine = BuildLocks(str(tmp_path), "model|cpu|num_pages=256")
    theirs = BuildLocks(str(tmp_path), "model|cpu|num_pages=512")
    with theirs.held((1, 1, 8, 1), wait=True):
        with mine.held((1, 1, 8, 1), wait=False) as got:
            assert got  # the same shape of another engine table is another program


def test_a_dead_builder_releases_its_locks(tmp_path):
    locks = BuildLocks(str(tmp_path), "model|cpu")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from pddjax.engines.build_locks import BuildLocks\n"
        f"l = BuildLocks({str(tmp_path)!r}, 'model|cpu')\n"
        "with l.held((1, 1, 8, 1), wait=True):\n"
        "    print('held', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with locks.held((1, 1, 8, 1), wait=False) as got:
            assert not got
    finally:
        holder.kill()
        holder.wait()
    with locks.held((1, 1, 8, 1), wait=False) as got:
        assert got
