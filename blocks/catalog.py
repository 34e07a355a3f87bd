"""The data catalog block: where the partition catalog lives."""

from __future__ import annotations

import os
import urllib.parse

from prefect.blocks.core import Block
from pydantic import ConfigDict, Field, SecretStr, field_validator


class DataCatalog(Block):
    """The catalog of input partitions (product x date -> digest, rows, location, site).

    Workspaces that name the same DataCatalog block share one catalog: a SQLite file on
    one host's disk (`path`), or a PostgreSQL database (`database_url`) that flows on
    several hosts share.

    Example:
        ```python
        from quantloop.blocks import DataCatalog
        print(DataCatalog.load("desk-catalog").resolved_path())
        ```
    """

    # A refused database URL's error must not echo it: it may hold the password.
    model_config = ConfigDict(hide_input_in_errors=True)

    _block_type_name = "quantloop Data Catalog"
    _block_type_slug = "quantloop-data-catalog"
    _description = (
        "Catalog of immutable input partitions and where they live (SQLite or PostgreSQL)."
    )

    path: str = Field(
        default=".quantloop/catalog.sqlite",
        description="Path of the SQLite catalog file (used when no database URL is given).",
    )
    database_url: SecretStr | None = Field(
        default=None,
        title="Database URL",
        description="A PostgreSQL database for the catalog, shared by flows on several "
        "hosts: postgresql://USER:PASSWORD@HOST:PORT/NAME (percent-encode special "
        "characters; kept secret: never shown or logged). Empty: the SQLite file at path.",
    )

    @field_validator("database_url")
    @classmethod
    def _postgresql_only(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        parts = urllib.parse.urlsplit(value.get_secret_value())
        if parts.scheme not in ("postgresql", "postgres") or not parts.hostname:
            # the URL may hold a password: name only its scheme
            raise ValueError(
                f"database_url: a postgresql://USER:PASSWORD@HOST:PORT/NAME URL, not a "
                f"{parts.scheme or 'schemeless'} one"
            )
        return value

    def resolved_path(self) -> str:
        """The catalog file's absolute path (runs may change directory)."""
        return os.path.abspath(os.path.expanduser(self.path))

    def where(self) -> str:
        """What the catalog opens: the database URL when one is given, else the file."""
        if self.database_url is not None:
            return self.database_url.get_secret_value()
        return self.resolved_path()
