"""Shared-memory segments (transfer/bufpool.py): created with their memory committed (a /dev/shm too small is an
error at creation, not a SIGBUS at a later write), removed when their creating process exits, and mapped into a
reader's page tables in the background when it attaches them (its first reads then take no page faults)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.transfer import bufpool
from jaxserve.transfer.bufpool import PAGE, SHM_DIR, ShmFull, attach_segment, create_segment, remove_segment

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX shared memory in /dev/shm")


@linux
def test_a_segment_larger_than_dev_shm_is_refused_at_creation_and_leaves_nothing():
    st = os.statvfs(SHM_DIR)
    if not st.f_blocks:
        pytest.skip(f"{SHM_DIR} has no size limit")
    too_big = st.f_blocks * st.f_frsize + PAGE  # more than the whole filesystem: refused before any allocation
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(ShmFull, match=f"cannot hold a shared-memory segment of {too_big} bytes .*free\\): "
                                      "a smaller x, or a larger /dev/shm"):
        create_segment(too_big, "a smaller x")
    assert set(os.listdir(SHM_DIR)) - before == set()
    assert not any(n.startswith(f"jaxserve-kv-{os.getpid()}-") for n in bufpool._OWNED)


@linux
def test_a_segment_is_allocated_whole_at_creation():
    name, mapping = create_segment(64 * PAGE)
    try:
        st = os.stat(os.path.join(SHM_DIR, name))
        assert st.st_size == 64 * PAGE and st.st_blocks * 512 >= 64 * PAGE  # backed now, not a hole
    finally:
        mapping.close()
        remove_segment(name)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEAVES = ("from jaxserve.transfer.bufpool import create_segment, remove_segment\n"
          "kept, m = create_segment(4096)\n"
          "gone, m2 = create_segment(4096)\n"
          "remove_segment(gone)\n"
          "print(kept, flush=True)\n")


@linux
@pytest.mark.parametrize("end", ["exit", "exit_now"])
def test_a_process_that_exits_removes_the_segments_it_created(end):
    """A normal exit (atexit), and a multi-process instance's member ending at once (worker/group.py `exit_now`:
    os._exit, which runs no atexit)."""
    code = LEAVES + ("from jaxserve.worker.group import exit_now\nexit_now(3)\n" if end == "exit_now" else "")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == (3 if end == "exit_now" else 0), out.stderr
    name = out.stdout.strip()
    assert name.startswith("jaxserve-kv-") and not os.path.exists(os.path.join(SHM_DIR, name))


@linux
def test_the_launcher_removes_what_a_dead_worker_left_when_it_starts_it_again():
    """A worker killed (or ended by os._exit) cannot remove its segments: starting it again removes them."""
    from jaxserve.router.launcher import Launcher
    code = LEAVES + "import os\nos._exit(0)\n"  # stands in for the worker: leaves one segment behind
    launcher = Launcher(None, ["w"], "127.0.0.1:1", wrap=lambda name, argv: [sys.executable, "-c", code])
    try:
        launcher.start_one("w")
        first = launcher.children["w"]
        assert first.proc.wait(60) == 0, first.output()
        left = first.output().strip()
        assert os.path.exists(os.path.join(SHM_DIR, left))
        launcher.start_one("w")
        assert not os.path.exists(os.path.join(SHM_DIR, left))
        assert launcher.children["w"].proc.wait(60) == 0
    finally:
        launcher.stop()
    again = launcher.children["w"].output().strip()
    assert again.startswith("jaxserve-kv-") and again != left
    assert not os.path.exists(os.path.join(SHM_DIR, again))  # stop removed it


def _faults_reading(mapping) -> int:
    """Minor page faults this process takes reading every page of `mapping` once."""
    a = np.frombuffer(mapping, np.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    total = int(a[::PAGE].sum())  # one byte per page
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del a
    assert total == 7 * (len(mapping) // PAGE)
    return after - before


@linux
@pytest.mark.parametrize("populated", [True, False])
def test_an_attached_segment_is_mapped_in_the_background(monkeypatch, populated):
    """Another process's segment, attached here: once `populate`'s thread is done, reading every page takes
    (next to) no fault; without it, one per page or per few (the kernel's fault-around)."""
    pages = 2048
    name, owner = create_segment(pages * PAGE)
    np.frombuffer(owner, np.uint8)[:] = 7
    threads = []
    real = bufpool.populate
    monkeypatch.setattr(bufpool, "populate", lambda m: threads.append(real(m) if populated else None))
    try:
        mapping = attach_segment(name)  # a second mapping: its page tables start empty
        if populated:
            threads[0].join(30)
            assert not threads[0].is_alive()
        faults = _faults_reading(mapping)
        if populated:
            assert faults < pages // 200, faults
        else:
            assert faults > pages // 100, faults  # one per page, or per few with the kernel's fault-around
        mapping.close()
    finally:
        owner.close()
        remove_segment(name)
