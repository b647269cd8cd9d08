"""Alembic environment for the spectune store.

Configured programmatically by :func:`telemetry.migrate.alembic_config`: the caller passes an open connection in
``config.attributes["connection"]`` (so URLs with ``%`` or passwords never pass through configparser), or a URL
as ``sqlalchemy.url``. The version table is ``spectune_alembic_version`` so optuna can share the database.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

from telemetry.schema import VERSION_TABLE, Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection | None = None, url: str | None = None) -> None:
    context.configure(
        connection=connection,
        url=url,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        render_as_batch=True,  # ALTER on SQLite works only through batch (copy-and-move) operations
        compare_type=True,
        literal_binds=connection is None,
    )


def run_migrations_offline() -> None:
    _configure(url=config.get_main_option("sqlalchemy.url"))
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database: pass a connection in config.attributes or set sqlalchemy.url")
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            _configure(connection=connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
