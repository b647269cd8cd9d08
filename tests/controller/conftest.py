"""Fixtures for the controller tests: real Redis, real SQLite and PostgreSQL, the shipped checkpoints.

Redis and PostgreSQL as in ``tests/telemetry`` (``SPECTUNE_TEST_REDIS_URL``, ``SPECTUNE_TEST_PG_URL``); each test
gets its own Redis key prefix / PostgreSQL schema. Model tests use the shipped checkpoints; while they are being
trained, ``SPECTUNE_CHECKPOINTS`` points at another folder (read here, and only here).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKPOINTS = Path(os.environ.get("SPECTUNE_CHECKPOINTS", str(REPO / "checkpoints")))
PYTHON = sys.executable


@pytest.fixture(scope="session")
def checkpoints() -> Path:
    if not (CHECKPOINTS / "manifest.json").exists():
        pytest.fail(f"no checkpoints at {CHECKPOINTS}; run `spectune train` or set SPECTUNE_CHECKPOINTS")
    return CHECKPOINTS


@pytest.fixture(scope="session")
def prompt_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prompt pool per test session and xdist worker (building it parses the standard library); each worker
    builds its own under its own temporary folder, so no two write one file."""
    from controller.reference.workload import PromptPool

    d = tmp_path_factory.mktemp("prompts")
    PromptPool(0, d)
    return d
