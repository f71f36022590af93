"""The leak checks see what they must: a child (and a grandchild), a thread, a file descriptor;
and nothing once it is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from triollm.testing import Snapshot, check_no_leaks, child_pids, wait_for_no_leaks


def test_a_grandchild_is_a_child_process() -> None:
    script = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
        "print(p.pid, flush=True); time.sleep(30)"
    )
    before = Snapshot.take()
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        assert {proc.pid, grandchild} <= child_pids()
        [children, fds] = Snapshot.take().leaks_since(before)  # the stdout pipe is an fd
        assert children.startswith("child processes left behind") and "file descriptors" in fds
        assert f"{proc.pid} (" in children and f"{grandchild} (" in children, children
    finally:
        os.kill(grandchild, 9)
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    assert wait_for_no_leaks(before, timeout=5) == []


def test_a_thread_and_a_file_descriptor_are_leaks_until_gone() -> None:
    stop = threading.Event()
    with pytest.raises(AssertionError, match=r"threads left behind: \['left-behind'\]") as info:
        with check_no_leaks(timeout=0.1):
            thread = threading.Thread(target=stop.wait, name="left-behind")
            thread.start()
            r, w = os.pipe()
    assert "file descriptors" in str(info.value) and "pipe:" in str(info.value)
    stop.set()
    thread.join()
    os.close(r)
    os.close(w)
    with check_no_leaks(timeout=0.1):
        thread = threading.Thread(target=lambda: None, name="ends")
        thread.start()
        thread.join()
