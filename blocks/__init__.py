"""Prefect blocks of quantloop; importing this package registers them with Prefect."""

from quantloop.blocks.catalog import DataCatalog
from quantloop.blocks.site import Site
from quantloop.blocks.tracking import MlflowTracking

__all__ = ["DataCatalog", "MlflowTracking", "Site"]
