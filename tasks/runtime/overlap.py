"""Work a command overlaps with its own: imports started ahead in a thread, and calls
handed to a fresh child of the warm process that forked the command.

A research run is one interpreter: two threads of Python share its lock, so work
"in the background" only overlaps where the other thread waits (on the Prefect API, on
files, on the GPU). On an H200 a run whose training changed spent ~3 s importing
Inductor before its first compiled step, and its model's registration (torch.export,
seconds of tracing) slowed the replay beside it by ~2 s (bench/results/
turnaround-h200-rows.md). So:

- `ahead(name, fn)` starts `fn` in a thread (an import the run will need) and
  `wait(name)` joins it where it is needed; what the thread spent is the total
  "ahead: <name>" of the run's timeline, the wait a phase of the caller's.
- `call(target, kwargs)` runs `module:function(**kwargs)` (JSON in, JSON out) in a fresh
  child of the warm process (quantloop/forkserver.py), on another core, with this
  command's environment, folder and streams; it raises `Unavailable` where there is no
  such process (an in-process command, another OS, the server gone or its code changed),
  and the caller does the work itself. Only the targets in forkserver.CALLS are run.

QUANTLOOP_OVERLAP=0 turns both off (and the compile workers' skip in
profiling/trainer.py): the comparison bench/turnaround.py makes in the same session.
"""

from __future__ import annotations

import array
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from quantloop.tasks.runtime import timeline

OFF_ENV = "QUANTLOOP_OVERLAP"
# One graph capture at a time in a process: torch.export (a registration's, when it runs
# here, in a thread beside the stages) and Inductor's lowering of a first compiled call
# share torch's global decomposition tables. Beside each other on an H200 the replay's
# compile failed, "both a fallback and a decomp for same op:
# aten.native_layer_norm.default" (bench/results/turnaround-h200-ahead-notes.md, call 6).
# Nor any model's forward beside torch.export: while it traces, the export turns oneDNN,
# NNPACK and cuDNN off for the whole process (torch/export/_trace.py,
# _ignore_backend_decomps) and fx routes every thread's nn.Module calls and attribute
# reads through its tracer (torch/fx/_symbolic_trace.py). A replay's eager forward beside
# an export gave other float32 rounding: 92 of 156 forwards on this 2-core VM differed
# from the same forward alone (up to 6e-8; tests/test_predictions.py), so its trades
# could depend on the registration's timing. The replay's Predictor holds this lock.
TRACING = threading.RLock()  # re-entrant: a capture that calls another in its thread
# The warm process that forked this command (its abstract socket's name); set in the
# command's process by quantloop/forkserver.py at the fork, None in any other process.
SERVER: str | None = None

_ahead: dict[str, threading.Thread] = {}
_lock = threading.Lock()


class Unavailable(RuntimeError):
    """No warm process to run a call in: the caller does the work itself."""


class CallFailed(RuntimeError):
    """The call raised in the warm process's child (its traceback is the message)."""


def enabled() -> bool:
    return os.environ.get(OFF_ENV, "1") != "0"


def ahead(name: str, fn: Callable[[], object]) -> bool:
    """Start `fn` in a daemon thread named `name` (once a process: a second start of the
    same name does nothing); False when overlap is off. An exception in `fn` is logged
    by the thread and dropped: the caller's own path does the same work again and
    raises it where it belongs."""
    if not enabled():
        return False
    with _lock:
        if name in _ahead:
            return True

        def run() -> None:
            with timeline.timed(f"ahead: {name}"):
                try:
                    fn()
                except Exception:  # noqa: BLE001 - done again, and raised, where needed
                    import logging

                    logging.getLogger(__name__).debug("ahead %s failed", name, exc_info=True)

        thread = threading.Thread(target=run, name=f"ahead-{name}", daemon=True)
        _ahead[name] = thread
    thread.start()
    return True


def wait(name: str) -> float | None:
    """Join the thread `ahead(name, ...)` started: the seconds waited, None if none was."""
    thread = _ahead.get(name)
    if thread is None:
        return None
    t0 = time.perf_counter()
    thread.join()
    return time.perf_counter() - t0


def available() -> bool:
    """Whether `call` can hand work to a warm process's child from here."""
    return SERVER is not None and enabled()


def environment() -> dict[str, str]:
    """os.environ as it is now, copied in one step: iterating it while another thread
    removes a variable raises KeyError."""
    data = dict(os.environ._data)  # type: ignore[attr-defined]  # a dict: one C call, atomic
    return {os.environ.decodekey(k): os.environ.decodevalue(v)  # type: ignore[attr-defined]
            for k, v in data.items()}  # fmt: skip


def call(target: str, kwargs: dict[str, Any]) -> Any:
    """`target(**kwargs)` ("module:function") in a fresh child of this command's warm
    process, with this process's environment, folder, sys.path and standard streams;
    its JSON result. Unavailable: no warm process here (do the work yourself);
    CallFailed: the function raised there. A kill of this process ends the child (its
    connection closes)."""
    if not available():
        raise Unavailable("not a command of a warm process" if SERVER is None
                          else f"{OFF_ENV}=0")  # fmt: skip
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(SERVER)
    except OSError as exc:
        sock.close()
        raise Unavailable(f"the warm process is gone ({exc})") from exc
    with sock:
        mask = os.umask(0o022)
        os.umask(mask)
        request = {"call": target, "kwargs": kwargs, "env": environment(),
                   "cwd": os.getcwd(), "umask": mask, "path": sys.path,
                   "started": time.time()}  # fmt: skip
        data = json.dumps(request).encode() + b"\n"
        try:
            sent = sock.sendmsg(
                [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))]
            )
            if sent < len(data):
                sock.sendall(data[sent:])
        except OSError as exc:
            raise Unavailable(f"the warm process went away ({exc})") from exc
        forked = False
        for line in sock.makefile("rb"):
            message = json.loads(line)
            if "stale" in message:  # the server ends itself: its code changed on disk
                raise Unavailable(f"the warm process's code changed ({message['stale']})")
            if "pid" in message:
                forked = True
            elif "result" in message:
                return message["result"]
            elif "error" in message:
                raise CallFailed(f"{target} failed in the warm process's child:\n"
                                 f"{message['error']}")  # fmt: skip
    if not forked:
        raise Unavailable("the warm process refused or closed before it forked")
    raise CallFailed(f"{target}: the warm process's child ended without an answer (killed?)")
