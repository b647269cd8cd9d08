"""Opening a database URL: the one place that knows how spectune connects to SQLite and PostgreSQL.

The stores (:mod:`telemetry.store`, :mod:`telemetry.alerts_store`) and the schema administration
(:mod:`telemetry.migrate`) open their databases here, so a connection option set for one holds for the others;
the stores derive from :class:`Database` and run every transaction through :func:`transaction`, which
translates database errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DataError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from telemetry.errors import StoreError, StoreRejectedError
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


@contextmanager
def transaction(sessions: sessionmaker[Session], what: str, url: str) -> Iterator[Session]:
    """One transaction: commit on success, roll back on error, always close; and the one place that turns
    SQLAlchemy's errors into the project's, so callers of a store catch only those.

    Args:
        sessions: the store's session factory.
        what: the operation, for the error message (``storing window batches``).
        url: the database, shown redacted in the error message.

    Raises:
        StoreRejectedError: the database refused the data (a constraint, a value out of range).
        StoreError: any other database failure (unreachable, locked, a driver error).
    """
    s = sessions()
    try:
        yield s
        s.commit()
    except BaseException as e:
        with contextlib.suppress(SQLAlchemyError):  # a dead connection cannot roll back; the error below says why
            s.rollback()
        if isinstance(e, IntegrityError | DataError):
            raise StoreRejectedError(f"{what}: the database refused the data: {e.orig}") from e
        if isinstance(e, SQLAlchemyError):
            raise StoreError(f"{what} failed on {redact_url(url)}: {e}; check that the database is reachable "
                             "(the operation can be retried)") from e
        raise
    finally:
        s.close()


class Database:
    """An open spectune database: the engine, its session factory, and the pieces every store shares.

    The base of :class:`telemetry.store.Store` and :class:`telemetry.alerts_store.AlertStore`. It does not check
    the schema revision (:mod:`telemetry.migrate` opens its engines here, so it cannot be imported from here);
    each store calls :func:`telemetry.migrate.check` before this constructor.

    Args:
        url: SQLAlchemy URL (SQLite or PostgreSQL).

    Raises:
        StoreError: the URL cannot be parsed or its driver is missing.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._engine = create_db_engine(url)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._dialect = self._engine.dialect.name

    def _session(self, what: str) -> contextlib.AbstractContextManager[Session]:
        """One transaction (:func:`transaction`): database errors leave as the project's."""
        return transaction(self._sessions, what, self.url)

    def _insert(self, table: Any) -> Any:
        """The dialect's ``INSERT`` for ``table`` (a mapped class), which has ``on_conflict_do_nothing``."""
        if self._dialect == "postgresql":
            return postgresql.insert(table)
        if self._dialect == "sqlite":
            return sqlite.insert(table)
        raise StoreError(f"dialect {self._dialect} is not supported; use SQLite or PostgreSQL")

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
