"""The `quantloop` executable: offer the command to a warm process (quantloop/forkserver.py),
else run it here.

Kept to the standard library until it knows which: the client's own start-up is what a
warm command costs beyond its work.
"""

from __future__ import annotations

import sys


def main() -> None:
    from quantloop import forkserver
    from quantloop.tasks.runtime.timeline import TIMELINE

    argv = sys.argv[1:]
    # `engine --warm` starts a warm process for another environment (a worker's flow
    # runs'): it runs here, not in one for its own
    warming = argv[:1] == ["engine"] and "--warm" in argv
    if forkserver.enabled() and argv and argv[0] in forkserver.COMMANDS and not warming:
        code = forkserver.run(argv, started=TIMELINE.origin)
        if code is not None:
            sys.exit(code)
    from quantloop.cli import console_main

    console_main()
