"""`python -m quantloop.cli`: the same commands as `quantloop`."""

from quantloop.cli import app

app()
