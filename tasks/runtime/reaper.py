"""Nothing outlives a killed run: a watcher process that ends this process's
descendants when it dies, even by SIGKILL.

A killed `quantloop run` would otherwise leave Prefect's temporary server (uvicorn,
~250 MB, holding its port) and the LocalCluster's nannies and workers running: they
are its children, and a SIGKILL gives it no chance to stop them (measured: 5 of 5
kills left them). The watcher is a small process in a session of its own, so a
signal to our process group does not reach it. It learns of our death from a pipe
(our end closes when we die, however we die: no polling for that) and meanwhile
records our descendants every POLL_S, so it knows whom to end even after the kernel
has re-parented them. A clean exit tells it so first, and it ends nobody.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import psutil

POLL_S = 0.25
GRACE_S = 5.0  # SIGTERM first (uvicorn and Dask shut down cleanly), then SIGKILL
DONE = b"done\n"


@contextlib.contextmanager
def reap_on_death() -> Iterator[subprocess.Popen]:
    """Inside this block, a death of this process ends all its descendants."""
    watcher = subprocess.Popen(
        [sys.executable, "-m", "quantloop.tasks.runtime.reaper", str(os.getpid())],
        stdin=subprocess.PIPE, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield watcher
    finally:
        # A clean exit (an exception included): our own code stops what it started.
        with contextlib.suppress(OSError):
            watcher.stdin.write(DONE)
            watcher.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(timeout=5)


def _identity(p: psutil.Process) -> tuple[int, float] | None:
    try:
        return p.pid, p.create_time()
    except psutil.Error:
        return None


def watch(parent_pid: int) -> None:
    """The watcher's main loop: record `parent_pid`'s descendants until our stdin says
    done (exit) or closes without saying it (the parent died: end what it left)."""
    parent = psutil.Process(parent_pid)
    me = os.getpid()  # a child of the parent too, not to be ended with the others
    seen: dict[int, float] = {}  # pid -> create time: a reused pid is not ours
    said: list[bytes] = []
    stdin_closed = threading.Event()

    def read() -> None:
        said.append(sys.stdin.buffer.read())
        stdin_closed.set()

    threading.Thread(target=read, daemon=True).start()
    while not stdin_closed.wait(POLL_S):
        with contextlib.suppress(psutil.Error):
            for child in parent.children(recursive=True):
                if child.pid != me and (ident := _identity(child)) is not None:
                    seen.setdefault(*ident)
    if said and said[0].startswith(DONE):
        return
    # The parent is gone: its descendants now hang off init; find them again by identity.
    with contextlib.suppress(psutil.Error):
        for child in parent.children(recursive=True):  # if the kernel has not yet re-parented
            if child.pid != me and (ident := _identity(child)) is not None:
                seen.setdefault(*ident)
    alive = []
    for pid, created in seen.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == created:
                p.send_signal(signal.SIGTERM)
                alive.append(p)
    _, still = psutil.wait_procs(alive, timeout=GRACE_S)
    for p in still:
        with contextlib.suppress(psutil.Error):
            p.kill()


if __name__ == "__main__":
    watch(int(sys.argv[1]))
