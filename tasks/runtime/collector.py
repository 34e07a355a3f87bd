"""The cyclic garbage collector paused while a process imports its stack, and what it
imported frozen after (`gc.freeze`).

Importing the flow's stack (Prefect, MLflow, torch, Inductor, scipy, the stages) makes
~650,000 objects the collector tracks, and the imports' own allocations trigger its full
passes over all of them: 8 passes, 1.1 s of the 6.2 s that `import quantloop.flows.research`
and its peers took on the 2-core VM, and 10 passes, 1.7 s, of a warm process's warm-up
(quantloop/forkserver.py). Imports make almost no cyclic garbage (tens to a few thousand
objects a pass), so pausing the collector meanwhile costs no memory to speak of.

Freezing moves the imported objects to the permanent generation, which no later pass
scans: a full pass then costs what the command made, not what it imported. In a child
forked from the warm process a full pass over the parent's objects also writes to, and so
copies, every page they live on: 0.52 s a pass on the VM, 0.00 s frozen (CPython's
`gc.freeze` documentation gives this pattern for a server that forks).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off inside; on leaving, everything alive frozen and the collector
    back on (if it was on: a caller that turned it off keeps it off)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.freeze()
            gc.enable()
