"""Alembic environment for the spectune store."""
