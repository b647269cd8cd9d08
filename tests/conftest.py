"""Shared test configuration.

Tests of the Redis and PostgreSQL paths run against real servers. Locally a missing server skips them with the
reason; under CI (``CI`` set, as `.ci/run` runs) a missing server fails them, so a green CI means they ran.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def service_unavailable(message: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI requires the real service; .ci/run starts it)", pytrace=False)
    pytest.skip(message)
