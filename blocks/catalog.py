"""The data catalog block: where the partition catalog lives."""

from __future__ import annotations

import os

from prefect.blocks.core import Block
from pydantic import Field

from tasks.catalog import Catalog


class DataCatalog(Block):
    """The catalog of input partitions (product x date -> digest, rows, location, site).

    Example:
        ```python
        from blocks.catalog import DataCatalog
        catalog = DataCatalog.load("desk-catalog").open()
        print(catalog.datasets())
        ```
    """

    _block_type_name = "quantloop Data Catalog"
    _block_type_slug = "quantloop-data-catalog"
    _description = "SQLite catalog of immutable input partitions and where they live."

    path: str = Field(
        default=".quantloop/catalog.sqlite", description="Path of the SQLite catalog file."
    )

    def open(self) -> Catalog:
        return Catalog(os.path.abspath(self.path))
