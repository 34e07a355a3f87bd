"""Rung 6, CUDA streams: pinned host memory and a copy stream that runs ahead of compute.

Before this rung every step gathers a fresh NumPy batch and copies each array with a
blocking `.to(device)`: the host waits for the GPU to drain before the copy, and the GPU
waits for the host's gather after it. Here a loader thread gathers step i+1's batch
straight into a pinned buffer (np.take(..., out=)) and issues its host-to-device copy on
a copy stream while the GPU computes step i; the compute stream waits on an event, never
the host. A batch travels as one flat byte buffer (`Layout`), so one copy moves it.

The 2-GPU half of this rung (overlapping DDP's gradient all-reduce with backward) is not
implemented here: see docs/ladder.md.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import numpy as np
import torch

ALIGN = 64  # bytes; every field of a flat batch starts on this boundary


class Layout:
    """Named arrays at fixed offsets of one flat uint8 buffer."""

    def __init__(self, spec: dict[str, tuple[tuple[int, ...], str]]) -> None:
        self.fields: list[tuple[str, tuple[int, ...], np.dtype, int]] = []
        offset = 0
        for name, (shape, dtype) in spec.items():
            dt = np.dtype(dtype)
            self.fields.append((name, tuple(shape), dt, offset))
            offset += -(-int(np.prod(shape)) * dt.itemsize // ALIGN) * ALIGN
        self.nbytes = offset

    def numpy_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        return {
            name: buf[off : off + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)
            for name, shape, dt, off in self.fields
        }

    def torch_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape, dt, off in self.fields:
            tdt = torch.from_numpy(np.zeros(0, dt)).dtype
            out[name] = buf[off : off + int(np.prod(shape)) * dt.itemsize].view(tdt).view(shape)
        return out


class SyncLoader:
    """Rungs 1-5: the step's batch freshly gathered in NumPy, each array copied blocking."""

    def __init__(self, make_batch: Callable[[int], dict[str, np.ndarray]], device: torch.device):
        self.make_batch = make_batch
        self.device = device

    def get(self, step: int) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        batch = self.make_batch(step)
        return None, {k: torch.from_numpy(v).to(self.device) for k, v in batch.items()}

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class Prefetcher:
    """A loader thread fills `depth` pinned buffers in turn and copies each on a side stream.

    get() makes the compute stream wait for the batch's copy (no host wait); release() marks
    the device buffer reusable once the work enqueued so far, which read it, has run.
    """

    def __init__(
        self,
        fill: Callable[[int, dict[str, np.ndarray]], object],
        layout: Layout,
        steps: int,
        device: torch.device,
        depth: int,
    ) -> None:
        self.fill, self.layout, self.steps, self.device, self.depth = (
            fill, layout, steps, device, depth,
        )  # fmt: skip
        self.pinned = [
            torch.empty(layout.nbytes, dtype=torch.uint8).pin_memory() for _ in range(depth)
        ]
        self.host_views = [layout.numpy_views(b.numpy()) for b in self.pinned]
        self.staging = [
            torch.empty(layout.nbytes, dtype=torch.uint8, device=device) for _ in range(depth)
        ]
        self.views = [layout.torch_views(b) for b in self.staging]
        self.copy_stream = torch.cuda.Stream(device)
        self.copied = [torch.cuda.Event() for _ in range(depth)]
        self.consumed = [torch.cuda.Event() for _ in range(depth)]
        self.free = threading.Semaphore(depth)
        self.ready: queue.Queue = queue.Queue()
        self.current = -1
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ladder-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with torch.cuda.device(self.device):
                for step in range(self.steps):
                    while not self.free.acquire(timeout=0.1):
                        if self._stop.is_set():
                            return
                    slot = step % self.depth
                    self.copied[slot].synchronize()  # its last copy out of the pinned buffer
                    self.fill(step, self.host_views[slot])
                    with torch.cuda.stream(self.copy_stream):
                        self.copy_stream.wait_event(self.consumed[slot])
                        self.staging[slot].copy_(self.pinned[slot], non_blocking=True)
                        self.copied[slot].record(self.copy_stream)
                    self.ready.put(slot)
        except BaseException as exc:  # surfaced by get()
            self.ready.put(exc)

    def get(self, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        slot = self.ready.get()
        if isinstance(slot, BaseException):
            raise RuntimeError("the prefetch thread failed") from slot
        torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        self.current = slot
        return self.staging[slot], self.views[slot]

    def release(self) -> None:
        self.consumed[self.current].record(torch.cuda.current_stream(self.device))
        self.free.release()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
