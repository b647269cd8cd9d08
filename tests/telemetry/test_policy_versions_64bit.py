"""policy_versions.version is 64-bit (a forged or long-lived version counter fits), on SQLite and PostgreSQL,
with a working downgrade."""

from __future__ import annotations

import pytest

from telemetry.migrate import current_revision, downgrade, upgrade
from telemetry.policy_table import MAX_POLICY_VERSION
from telemetry.records import PolicyTable
from telemetry.store import Store


@pytest.mark.parametrize("version", [2**31, 2**40, MAX_POLICY_VERSION])
def test_versions_past_32_bits_are_stored(db_url: str, version: int) -> None:
    upgrade(db_url)
    with Store(db_url) as s:
        s.save_policy_version(PolicyTable(version=version - 1, default_k=1, created_at=1.0))
        s.save_policy_version(PolicyTable(version=version, default_k=2, created_at=2.0))
        assert [t.version for t in s.policy_versions(limit=5)] == [version, version - 1]


def test_the_bigint_revision_goes_down_and_up_again(db_url: str) -> None:
    upgrade(db_url)
    with Store(db_url) as s:
        s.save_policy_version(PolicyTable(version=7, default_k=1, created_at=1.0))
    downgrade(db_url, "0001_initial")
    assert current_revision(db_url) == "0001_initial"
    upgrade(db_url)
    assert current_revision(db_url) == "0005_scrape_baselines"
    with Store(db_url) as s:
        assert s.latest_policy_version() is not None and s.latest_policy_version().version == 7  # type: ignore[union-attr]
