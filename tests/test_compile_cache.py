"""Inductor's kernels kept in the workspace's store (profiling/compile_cache.py): a fresh
process (a new worker, an emptied /tmp) loads every graph from it, traced and lowered
nothing again (on a CPU the entries' C++ is still built: docs/limits.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantloop.profiling.compile_cache import PREFIX, cache_key, kept, precompile_supported

# A fresh process: its own Inductor cache folder, so only the store can give it kernels.
COMPILE = """
import json, sys, torch
from quantloop.profiling.compile_cache import kept
root = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
with kept(root, torch.device("cpu"), {"test": "mlp"}) as info:
    step = torch.compile(model)
    step(torch.randn(32, 8)).sum().backward()
print(json.dumps(info))
"""


# The same with Dynamo's packages (precompile): the weights are arguments, as the stack's
# are (serialized guards leave out those on globals); wrapped inside the block.
PRECOMPILE = """
import json, sys, torch
from quantloop.profiling.compile_cache import compile_times, kept
root = sys.argv[1]
torch.manual_seed(0)
w1, w2 = torch.randn(8, 16, requires_grad=True), torch.randn(16, 1, requires_grad=True)
x = torch.randn(32, 8)
def loss(w1, w2, x):
    return torch.nn.functional.gelu(x @ w1).matmul(w2).square().mean()
with kept(root, torch.device("cpu"), {"test": "loss"}, precompile=True) as info:
    step = torch.compile(loss)
    step(w1, w2, x).backward()
print(json.dumps({**info, "traced": compile_times().get("frames"),
                  "grad": [w1.grad.flatten().tolist(), w2.grad.flatten().tolist()]}))
"""


def compile_in_a_fresh_process(root: Path, inductor_dir: Path, script: str = COMPILE) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    proc = subprocess.run([sys.executable, "-c", script, str(root)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_a_store_nothing_is_read_or_kept():
    with kept(None, torch.device("cpu"), {}) as info:
        pass
    assert info == {"state": "off"}


def test_the_key_names_torch_the_device_class_and_the_parts():
    cpu = torch.device("cpu")
    assert cache_key(cpu, {"batch": 256}) == cache_key(cpu, {"batch": 256})
    assert cache_key(cpu, {"batch": 256}) != cache_key(cpu, {"batch": 512})


@pytest.mark.slow
def test_a_fresh_process_loads_every_graph_from_the_store(tmp_path):
    """Inductor on a CPU (a C++ build, ~25 s here): the first process compiles and stores;
    a second one, with an empty Inductor cache of its own, loads the store's blob and
    every graph is a hit of both caches (on a CPU the entries' C++ is still built again:
    13.6 s against 15.1 s cold, one run each); a damaged blob costs a compile, never the
    run."""
    root = tmp_path / "store"
    first = compile_in_a_fresh_process(root, tmp_path / "inductor-1")
    assert first["state"] == "missing" and first["misses"] > 0 and first["stored_bytes"] > 0
    [blob] = (root / PREFIX).iterdir()
    assert blob.name == f"{first['key']}.bin"

    second = compile_in_a_fresh_process(root, tmp_path / "inductor-2")
    assert second["state"] == "loaded", second
    assert second["hits"] > 0 and second["misses"] == 0, second
    # and AOTAutograd's entries with them: the joint graph is not traced again either
    assert second["aot_hits"] > 0 and second["aot_bypassed"] == 0, second

    blob.write_bytes(b"not a cache")
    third = compile_in_a_fresh_process(root, tmp_path / "inductor-3")
    assert third["state"].startswith("unreadable") and third["misses"] > 0, third
    assert third["stored_bytes"] > 0 and blob.read_bytes() != b"not a cache"


@pytest.mark.slow
@pytest.mark.skipif(not precompile_supported(), reason="this torch keeps no Dynamo packages")
def test_with_dynamos_packages_a_fresh_process_traces_nothing(tmp_path):
    """precompile: the second process installs the stored function without Dynamo tracing
    it (no frame compiled), and its gradients are the first process's bit for bit; the
    machine's own packages, left by a compile of another key, are not installed."""
    root = tmp_path / "store"
    first = compile_in_a_fresh_process(root, tmp_path / "inductor-1", PRECOMPILE)
    assert first["state"] == "missing" and first["precompile"], first
    assert first["dynamo_misses"] == 1 and first["traced"] > 0 and first["stored_bytes"] > 0

    second = compile_in_a_fresh_process(root, tmp_path / "inductor-2", PRECOMPILE)
    assert second["state"] == "loaded" and second["dynamo_hits"] == 1, second
    assert second["traced"] == 0, second
    assert second["grad"] == first["grad"]

    # Another key on the first machine (its package of `loss` still on disk there): traced
    other = compile_in_a_fresh_process(tmp_path / "other-store", tmp_path / "inductor-1",
                                       PRECOMPILE)  # fmt: skip
    assert other["state"] == "missing" and other["dynamo_hits"] == 0 and other["traced"] > 0
