"""The servers' databases on PostgreSQL: what `quantloop serve --database` runs on.

One URL names a PostgreSQL server, a role and a base name; each server gets a database
of its own named after it, so that no two share a table namespace (Prefect's and
MLflow's migrations both keep an `alembic_version` table, and so does MLflow's auth app):

    postgresql://quantloop:PASSWORD@dbhost:5432/desk
        desk_prefect        Prefect's server     (postgresql+asyncpg://..., its driver)
        desk_mlflow         MLflow's tracking and model registry stores (+psycopg2)
        desk_mlflow_auth    MLflow's basic-auth users and permissions (+psycopg2)

A database that is missing is created, owned by the URL's role, when that role may
(CREATEDB); otherwise the error gives the SQL an operator runs (infra/README.md,
"PostgreSQL"). The password never reaches a command line or a printed line: `masked()`
is what is shown, and the servers get their URLs in their environment or a 0600 file.
"""

from __future__ import annotations

import dataclasses
import urllib.parse

SERVERS = ("prefect", "mlflow", "mlflow_auth")
SCHEMES = ("postgresql", "postgres")


class DatabaseError(ValueError):
    """A --database URL that cannot be used, said in one line."""


@dataclasses.dataclass(frozen=True)
class ServerDatabases:
    """A PostgreSQL server, role and base name (`url`), and the databases named after it."""

    url: str

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in SCHEMES:
            raise DatabaseError(
                f"--database {self.masked()}: not a postgresql:// URL "
                "(postgresql://USER:PASSWORD@HOST:PORT/NAME; without --database, "
                "serve keeps SQLite files under its home)"
            )
        name = parts.path.lstrip("/")
        if not name or "/" in name or not parts.hostname or not parts.username:
            raise DatabaseError(
                f"--database {self.masked()}: give a user, a host and a base name: "
                "postgresql://USER:PASSWORD@HOST:PORT/NAME"
            )
        if not all(c.isalnum() or c == "_" for c in name):
            raise DatabaseError(
                f"--database {self.masked()}: base name {name!r} may hold letters, digits "
                "and _ only (the databases are NAME_prefect, NAME_mlflow, NAME_mlflow_auth)"
            )

    @property
    def base(self) -> str:
        return urllib.parse.urlsplit(self.url).path.lstrip("/")

    def name(self, server: str) -> str:
        return f"{self.base}_{server}"

    def for_server(self, server: str, driver: str | None = None) -> str:
        """The URL of `server`'s database, with a SQLAlchemy driver if given."""
        parts = urllib.parse.urlsplit(self.url)
        scheme = "postgresql" + (f"+{driver}" if driver else "")
        return urllib.parse.urlunsplit(parts._replace(scheme=scheme, path="/" + self.name(server)))

    @property
    def prefect(self) -> str:
        return self.for_server("prefect", "asyncpg")

    # psycopg2 named: SQLAlchemy 2.1's default PostgreSQL driver is psycopg 3.
    @property
    def mlflow(self) -> str:
        return self.for_server("mlflow", "psycopg2")

    @property
    def mlflow_auth(self) -> str:
        return self.for_server("mlflow_auth", "psycopg2")

    def masked(self, url: str | None = None) -> str:
        """`url` (this one by default) with its password as ***: what may be printed."""
        return masked(url or self.url)

    def ensure(self) -> list[str]:
        """Create the databases that are missing (connected to the server's `postgres`
        database, as createdb is), owned by this role; the names it created."""
        import psycopg2
        from psycopg2 import sql

        maintenance = urllib.parse.urlunsplit(
            urllib.parse.urlsplit(self.url)._replace(scheme="postgresql", path="/postgres")
        )
        try:
            conn = psycopg2.connect(maintenance, connect_timeout=10)
        except psycopg2.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DatabaseError(f"--database {self.masked()}: cannot connect: {first}") from exc
        created = []
        try:
            conn.autocommit = True  # CREATE DATABASE runs outside a transaction
            with conn.cursor() as cur:
                wanted = [self.name(s) for s in SERVERS]
                cur.execute("SELECT datname FROM pg_database WHERE datname = ANY(%s)", (wanted,))
                have = {row[0] for row in cur.fetchall()}
                for db in (d for d in wanted if d not in have):
                    try:
                        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
                    except psycopg2.errors.InsufficientPrivilege as exc:
                        user = urllib.parse.urlsplit(self.url).username
                        raise DatabaseError(
                            f"--database {self.masked()}: database {db} is missing and role "
                            f"{user} may not create it; as an administrator run: "
                            f'CREATE DATABASE "{db}" OWNER "{user}";'
                        ) from exc
                    created.append(db)
        finally:
            conn.close()
        return created


def masked(url: str) -> str:
    """A URL with its password (if any) replaced by ***."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))
