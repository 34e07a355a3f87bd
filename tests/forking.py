"""A check run in a forked child of the test's process (what a warm process's command or a
forked worker sees): True when it returned True there."""

from __future__ import annotations

import os
from collections.abc import Callable


def in_forked_child(check: Callable[[], bool]) -> bool:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, b"1" if check() else b"0")
        finally:
            os._exit(0)  # no exit handlers of the parent's in the child
    os.close(write)
    try:
        return os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
