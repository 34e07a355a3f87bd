"""Import quantloop from a bare checkout: the GPU machine has torch, Triton and pyarrow but
no quantloop install.

The repository's top-level folders (flows/, tasks/, blocks/, models/, profiling/) become
quantloop.flows, quantloop.tasks, ... only through the installed package (setuptools
package-dir), so a checkout on sys.path gives `quantloop` without them. use_checkout()
adds an import finder that maps each package to its folder, read from the same
[tool.setuptools.package-dir] table of pyproject.toml; where quantloop is installed it
does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import tomllib
from importlib.machinery import ModuleSpec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path) -> dict[str, Path]:
    """Import name -> folder, as pyproject.toml maps them ({"quantloop.tasks": root/"tasks"})."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds quantloop and its subpackages in a checkout's folders; the modules inside them
    are then found through each package's __path__, as usual."""

    def __init__(self, root: Path) -> None:
        self.dirs = package_dirs(root)

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        folder = self.dirs.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def use_checkout(root: Path = ROOT) -> bool:
    """Make `import quantloop.<package>` find `root`'s folders unless quantloop is installed;
    True when it had to."""
    try:
        import quantloop.profiling  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, CheckoutFinder(root))
        return True
    return False
