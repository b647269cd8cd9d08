"""Alembic revisions of the spectune store, numbered in order (0001_initial, 0002_...)."""
