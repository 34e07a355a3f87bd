"""`python -m quantloop`: the same as the `quantloop` executable (a warm process if one is
up, quantloop/forkserver.py); `python -m quantloop.cli` always runs in this process."""

from quantloop.launch import main

main()
