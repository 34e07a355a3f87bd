"""The data catalog block: where the partition catalog lives."""

from __future__ import annotations

import os

from prefect.blocks.core import Block
from pydantic import Field


class DataCatalog(Block):
    """The catalog of input partitions (product x date -> digest, rows, location, site).

    Workspaces that name the same DataCatalog block share one catalog.

    Example:
        ```python
        from quantloop.blocks import DataCatalog
        print(DataCatalog.load("desk-catalog").resolved_path())
        ```
    """

    _block_type_name = "quantloop Data Catalog"
    _block_type_slug = "quantloop-data-catalog"
    _description = "SQLite catalog of immutable input partitions and where they live."

    path: str = Field(
        default=".quantloop/catalog.sqlite", description="Path of the SQLite catalog file."
    )

    def resolved_path(self) -> str:
        """The catalog file's absolute path (runs may change directory)."""
        return os.path.abspath(os.path.expanduser(self.path))
