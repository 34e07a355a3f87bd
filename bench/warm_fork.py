"""Children of a warm process do their work: run on a GPU machine after a change to the
warm process's warm-up (quantloop/forkserver.warm_up), before a benchmark relies on it.

    python bench/warm_fork.py

In this process, the warm-up, as the server makes it; then, each in a forked child as
the server forks one: the registration's export of a research-shape model (CPU, as
tasks/records/registry.export_stored does it) and, where CUDA is there, a compiled
training step of the same model on the GPU. Beside them, the same export in a fresh
interpreter without the warm-up (the cold peer). One JSON line: each child's seconds
and its error, if any (a line after each part: a call cut short keeps what it had).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

EXPORT = r"""
import time, numpy as np, torch
from quantloop.models.orderbook import ModelConfig, OrderBookNet
from quantloop.models.predictor import Predictor
from quantloop.tasks.records import registry
t = time.perf_counter()
cfg = ModelConfig(n_features=12, n_outputs=3, d_model=128, n_layers=4, n_heads=4, ff_mult=4,
                  max_len=256)
one, zero = torch.ones(12), torch.zeros(12)
model = Predictor(OrderBookNet(cfg), zero, one, torch.zeros(3), torch.ones(3), 5.0).eval()
example = np.random.default_rng(0).normal(size=(4, 256, 12)).astype(np.float32)
registry.save_exported(model, example, DIR + "/model", {"artifact_path": DIR,
                       "model_uuid": "m", "run_id": "r", "model_id": "m"})
SECONDS = time.perf_counter() - t
"""

TRAIN = r"""
import time, torch
from quantloop.models.orderbook import ModelConfig, OrderBookNet
t = time.perf_counter()
cfg = ModelConfig(n_features=12, n_outputs=3, d_model=128, n_layers=4, n_heads=4, ff_mult=4,
                  max_len=256)
net = OrderBookNet(cfg).cuda()
step = torch.compile(lambda x: net(x).square().mean())
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
for _ in range(3):
    loss = step(torch.randn(32, 64, 12, device="cuda"))
    loss.backward()
    opt.step()
    opt.zero_grad()
torch.cuda.synchronize()
SECONDS = time.perf_counter() - t
"""


def in_child(code: str) -> dict:
    """`code` run in a forked child of this process; its seconds or its error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            scope = {"DIR": tempfile.mkdtemp()}
            exec(code, scope)
            out = {"seconds": round(scope["SECONDS"], 2)}
        except BaseException as exc:  # reported, not raised: the parent goes on
            out = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b'{"error": "the child died"}')


def main() -> None:
    cold_code = (
        "import importlib, json, tempfile, time\n"
        "from quantloop import forkserver\n"
        "for m in forkserver.WARM_MODULES: importlib.import_module(m)\n"
        "scope = {'DIR': tempfile.mkdtemp()}\n"
        f"exec({EXPORT!r}, scope)\n"
        "print(json.dumps({'seconds': round(scope['SECONDS'], 2)}))\n"
    )
    cold = subprocess.Popen([sys.executable, "-c", cold_code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    from quantloop import forkserver

    t0 = time.perf_counter()
    forkserver.warm_up()
    out: dict = {"warm_up_s": round(time.perf_counter() - t0, 2),
                 "device_open": forkserver._cuda_opened()}  # fmt: skip
    out["export_in_child"] = in_child(EXPORT)
    import torch

    print(json.dumps(out), flush=True)
    if torch.cuda._is_compiled():
        with forkserver.cuda_asked_of_devices():
            gpu = torch.cuda.is_available()
        if gpu:
            out["compiled_training_in_child"] = in_child(TRAIN)
            print(json.dumps(out), flush=True)
    stdout, stderr = cold.communicate(timeout=600)
    lines = stdout.strip().splitlines()
    out["export_cold_interpreter"] = json.loads(lines[-1]) if lines else {"error": stderr[-1500:]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
