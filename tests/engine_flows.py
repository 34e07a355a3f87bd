"""A flow for tests/test_deployment.py's warm flow runs: it says where it ran."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prefect import flow


@flow(name="where-it-ran")
def where_it_ran(out: str, sleep_s: float = 0.0) -> None:
    """Write this process's pid, whether it is a warm process's child (quantloop/
    forkserver.py) and its environment to `out`, then sleep `sleep_s` (a run to cancel)."""
    from quantloop import forkserver

    Path(out).write_text(json.dumps({"pid": os.getpid(), "warm": forkserver.IN_CHILD,
                                     "env": dict(os.environ)}))  # fmt: skip
    time.sleep(sleep_s)
