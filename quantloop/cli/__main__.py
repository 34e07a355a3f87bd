"""`python -m quantloop.cli`: the same commands, and the same exit, as `quantloop`."""

from quantloop.cli import console_main

console_main()
