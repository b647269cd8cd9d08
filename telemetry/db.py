"""Opening a database URL: the one place that knows how spectune connects to SQLite and PostgreSQL.

Both the store (:mod:`telemetry.store`) and the schema administration (:mod:`telemetry.migrate`) open their
databases here, so a connection option set for one holds for the other.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from telemetry.errors import StoreError
from telemetry.urls import redact_url

SQLITE_BUSY_TIMEOUT_MS = 10_000  # a writer waits this long for another's lock before failing


def create_db_engine(url: str) -> Engine:
    """An SQLAlchemy engine for ``url``; SQLite gets WAL, a busy timeout and foreign keys on.

    Raises:
        StoreError: the URL cannot be parsed or its driver is missing.
    """
    try:
        u = make_url(url)
        if u.get_backend_name() == "sqlite":
            eng = create_engine(u, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
            memory = u.database in (None, "", ":memory:")

            @event.listens_for(eng, "connect")
            def _pragmas(dbapi_conn: Any, _record: Any) -> None:
                cur = dbapi_conn.cursor()
                if not memory:
                    cur.execute("PRAGMA journal_mode=WAL")  # readers do not block the ingesting writer
                    cur.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; safe with WAL
                cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()

            return eng
        return create_engine(u, pool_pre_ping=True)
    except (ArgumentError, ImportError, SQLAlchemyError) as e:
        raise StoreError(f"cannot open database {redact_url(url)}: {e}") from e
