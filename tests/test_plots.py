"""The records' figures (tasks/records/plots.py): drawn on matplotlib's object API, so a
thread may draw its own beside another's (the train run's loss figure is drawn in the
registration thread while the simulate stage draws its mark-out curve)."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from quantloop.tasks.records import plots

HORIZONS = ["1s", "5s", "30s", "10ev", "100ev"]
CURVES = {
    "model": {h: 0.1 * i for i, h in enumerate(HORIZONS)},
    "baseline": {h: -0.1 * i for i, h in enumerate(HORIZONS)},
}
ERRORS = {name: {h: 0.05 for h in HORIZONS} for name in CURVES}


def draw(i: int) -> bytes:
    if i % 2:
        return plots.png(plots.markout_curve(CURVES, ERRORS))
    return plots.png(plots.loss_curve([1.0 / (k + 1) for k in range(40)], 25))


def test_figures_drawn_in_many_threads_at_once_are_the_figures_drawn_alone():
    """The output a record gets from a thread is the one it would get alone (pyplot's
    version also passed this here, 5 x 48 figures: the registry is not what this
    catches, but the next piece of shared state a figure might grow)."""
    alone = [draw(0), draw(1)]
    assert alone[0].startswith(b"\x89PNG") and alone[1].startswith(b"\x89PNG")
    assert alone[0] != alone[1]
    with ThreadPoolExecutor(8) as pool:
        drawn = list(pool.map(draw, range(48)))
    wrong = [i for i, png in enumerate(drawn) if png != alone[i % 2]]
    assert wrong == []


def test_drawing_a_figure_imports_no_pyplot():
    """pyplot keeps every figure it made in one registry for all threads (and picks a
    backend at import): the records never import it."""
    code = (
        "import sys\n"
        "from quantloop.tasks.records import plots\n"
        "png = plots.png(plots.loss_curve([1.0, 0.5], 5))\n"
        "print(png[:4] == b'\\x89PNG', 'matplotlib.pyplot' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "False"]
