"""Prefect blocks of quantloop; importing this package registers them with Prefect."""

from blocks.catalog import DataCatalog
from blocks.site import Site
from blocks.tracking import MlflowTracking

__all__ = ["DataCatalog", "MlflowTracking", "Site"]
