"""Inductor's compiled kernels kept with the workspace, so a fresh worker trains without
compiling again.

torch.compile's warm-up is most of a short GPU training's fixed cost: 42.4 s before the
first steady step of a 16-model stack with an empty Inductor cache on an H200, 3.4 s with
the cache an earlier process filled (bench/results/sweep-h200-check.md). That cache is a
folder on the machine that compiled (TORCHINDUCTOR_CACHE_DIR); a new worker, or the same
machine after /tmp was emptied, compiles again. Here the process's cache artifacts (FX
graph, AOTAutograd and Triton entries: `torch.compiler.save_cache_artifacts`, PyTorch's
"mega-cache") are stored in the workspace's store under a key of what decides the
kernels (torch version, device class, the training code's digest, the shapes and the
rungs), and loaded (`load_cache_artifacts`) before the next compile with that key,
wherever the store is (a local folder or S3).

Inductor still checks each graph against its own cache key, so a stored entry that does
not fit (another batch shape, a changed pass) is a miss, compiled and stored again: a
stale blob costs a compile, never a wrong kernel.

Those caches keep what comes after Dynamo, not Dynamo's own work: a process that loads
them still traces each function's Python, builds its guards and looks each graph up (a
4-model stack of tests/test_stacked.py on this 2-core CPU: 2.0-2.8 s of Dynamo over its
3 frames). With `precompile`, torch's Dynamo packages travel in the same blob
(`torch._dynamo.config.caching_precompile`, experimental: the compiled bytecode, its
serializable guards and the backend's compiled graphs, `DynamoCache`), so a function
wrapped by torch.compile inside the block is installed already compiled: that stack
traced no frame, its weights bit for bit those of a compile. On a CPU the C++ is still
built from the stored source (23.3 and 27.8 s there, against 26.0 and 26.6 without);
what it saves on a GPU, where nothing is built, is not measured yet. torch looks a
function's package up when the function is wrapped, so the wrapping must happen inside
the block (stacked.py wraps at the first call), and the machine's own Dynamo packages
are dropped first: only the store's, which this key names, may be installed (a package
keyed by the function's source alone could come from another shape or switch, and
serialized guards leave out those on globals).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from quantloop.tasks.engine import storage

PREFIX = "compile-cache"
log = logging.getLogger(__name__)


def device_class(device: torch.device) -> str:
    """What a compiled kernel is specific to: the GPU's name and compute capability, or
    the CPU's instruction set."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    return f"{device.type}:{torch.backends.cpu.get_cpu_capability()}"


def cache_key(device: torch.device, parts: Mapping[str, Any]) -> str:
    values = {"torch": torch.__version__, "device": device_class(device), **parts}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


COUNTERS = {  # what kept() reports: torch's counter of each (its group, its name)
    "hits": ("inductor", "fxgraph_cache_hit"),
    "misses": ("inductor", "fxgraph_cache_miss"),
    # AOTAutograd's cache sits before Inductor's: a graph it bypasses (torch 2.13: one with
    # a custom autograd Function, or one that enters autocast inside the compiled function)
    # is traced and partitioned again in every process, Inductor's hits notwithstanding
    # (bench/results/sweep-h200-notes.md, after call 5)
    "aot_hits": ("aot_autograd", "autograd_cache_hit"),
    "aot_misses": ("aot_autograd", "autograd_cache_miss"),
    "aot_bypassed": ("aot_autograd", "autograd_cache_bypass"),
    # Dynamo's packages (precompile): a hit installs a function without tracing it
    "dynamo_hits": ("dynamo_cache", "dynamo_cache_hit"),
    "dynamo_misses": ("dynamo_cache", "dynamo_cache_miss"),
}


def counts() -> dict[str, int]:
    """This process's compile-cache counters so far, by COUNTERS' names."""
    from torch._dynamo.utils import counters

    return {name: counters[group][key] for name, (group, key) in COUNTERS.items()}


def compile_times() -> dict[str, float]:
    """Seconds torch.compile spent in this process so far, summed over its compiled frames
    (torch._dynamo.utils.get_compilation_metrics, private: {} where torch has none):
    `total_s`, each frame's whole compile; `backend_s`, AOTAutograd's and Inductor's part
    of it (with a loaded store, reading the caches, and on a CPU building their C++
    again); `dynamo_s`, the rest: Dynamo's own part (the trace of the Python, guards,
    bytecode), which no cache keeps. torch keeps the last 64 frames' metrics only."""
    try:
        from torch._dynamo.utils import get_compilation_metrics

        metrics = list(get_compilation_metrics())
    except Exception:  # noqa: BLE001 - a figure for the bench, never the run's failure
        return {}
    total = sum(getattr(m, "entire_frame_compile_time_s", None) or 0.0 for m in metrics)
    backend = sum(getattr(m, "backend_compile_time_s", None) or 0.0 for m in metrics)
    return {"frames": len(metrics), "total_s": round(total, 3), "backend_s": round(backend, 3),
            "dynamo_s": round(total - backend, 3)}  # fmt: skip


def precompile_supported() -> bool:
    """Whether this torch keeps Dynamo's packages in its cache artifacts (the setting and
    the machine's package store both present: experimental, and moving between versions)."""
    try:
        from torch._dynamo.package import DynamoCache
    except ImportError:
        return False
    return hasattr(torch._dynamo.config, "caching_precompile") and hasattr(DynamoCache, "clear")


@contextlib.contextmanager
def _dynamo_packages(on: bool) -> Iterator[None]:
    """Dynamo's packages recorded, saved and installed for the block (caching_precompile),
    the machine's own dropped first; nothing when off. Another process of the machine in
    such a block meanwhile loses at worst its package files: a load that fails traces, a
    save that fails stores the rest (kept's warning)."""
    if not on:
        yield
        return
    from torch._dynamo.package import DynamoCache

    with torch._dynamo.config.patch(caching_precompile=True):
        DynamoCache.clear()
        yield


@contextlib.contextmanager
def kept(
    root: str | None, device: torch.device, parts: Mapping[str, Any], *,
    precompile: bool = False,
) -> Iterator[dict]:  # fmt: skip
    """Load the artifacts stored under `root` for this key before the block; after it,
    store the process's artifacts when the block compiled a graph the store did not hold.
    Yields what happened: {"key", "state": off | loaded | missing | unreadable, "read_s"
    and "load_s" (the store's bytes read, then handed to torch), "hits",
    "misses" (Inductor's FX graphs), "aot_hits", "aot_misses", "aot_bypassed"
    (AOTAutograd's cache: a bypassed graph is traced again in each process, and said in
    the log), "dynamo_hits", "dynamo_misses" (precompile: functions installed from a
    package, or traced), "stored_bytes"}. root None: nothing is read or stored.

    precompile: Dynamo's packages too (the module docstring), where torch has them; they
    are part of the key, so a store made without them is never read for them. Functions
    must be wrapped by torch.compile inside the block."""
    if root is None:
        yield {"state": "off"}
        return
    precompile = precompile and precompile_supported()
    with _dynamo_packages(precompile):
        # (a key without it: the stores made before it are still found)
        yield from _kept(root, device, {**parts, "precompile": True} if precompile else parts)


def _kept(root: str, device: torch.device, parts: Mapping[str, Any]) -> Iterator[dict]:
    key = cache_key(device, parts)
    url = storage.join(root, PREFIX, f"{key}.bin")
    info: dict[str, Any] = {"key": key, "state": "missing",
                            "precompile": bool(parts.get("precompile"))}  # fmt: skip
    if storage.exists(url):
        try:
            t0 = time.perf_counter()
            blob = storage.read_bytes(url)
            info["read_s"] = round(time.perf_counter() - t0, 4)
            # None (not an exception) for bytes that hold no artifacts
            loaded = torch.compiler.load_cache_artifacts(blob)
            info["load_s"] = round(time.perf_counter() - t0 - info["read_s"], 4)
            info["state"] = "loaded" if loaded else "unreadable: no artifacts in it"
        except Exception as exc:  # noqa: BLE001 - a bad blob costs a compile, not the run
            info["state"] = f"unreadable: {type(exc).__name__}: {exc}"
            log.warning("compile cache %s unreadable (%s): compiling", url, exc)
    before = counts()
    yield info
    info.update({name: n - before[name] for name, n in counts().items()})
    if info["aot_bypassed"]:
        log.warning("AOTAutograd's cache bypassed %d graph(s) of %s: a process loading this "
                    "store traces them again (torch's log says why)", info["aot_bypassed"],
                    key[:12])  # fmt: skip
    if info["misses"] or info["dynamo_misses"] or info["state"] != "loaded":
        try:
            artifacts = torch.compiler.save_cache_artifacts()
        except Exception as exc:  # noqa: BLE001 - Dynamo's packages (experimental) failed
            log.warning("compile cache %s: Dynamo's packages not saved (%s): the rest is",
                        key[:12], exc)  # fmt: skip
            with torch._dynamo.config.patch(caching_precompile=False):
                artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is not None and artifacts[0]:
            storage.write_bytes_atomic(url, artifacts[0])
            info["stored_bytes"] = len(artifacts[0])
