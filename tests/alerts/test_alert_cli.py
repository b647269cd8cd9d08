"""``spectune alerts list | ack ID`` on a real SQLite store."""

from __future__ import annotations

import pytest

from controller.cli import main
from telemetry.alerts import MODEL_UPDATE, Alert
from telemetry.alerts_store import AlertStore
from telemetry.migrate import upgrade


def test_alerts_list_and_ack(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    upgrade(sqlite_url)
    with AlertStore(sqlite_url) as st:
        a = st.add(Alert(kind=MODEL_UPDATE, bucket="t2|d1|*|*|*", target_version="t2", draft_version="d1",
                         detected_at=1.0, message="model update: t1 / d1 -> t2 / d1"))
    assert main(["alerts", "list", "--db-url", sqlite_url]) == 0
    assert "model update: t1 / d1 -> t2 / d1" in capsys.readouterr().out
    assert main(["alerts", "ack", str(a.id), "--by", "alice", "--db-url", sqlite_url]) == 0
    assert "acked by alice" in capsys.readouterr().out
    assert main(["alerts", "list", "--db-url", sqlite_url]) == 0
    assert capsys.readouterr().out == ""  # acked alerts are hidden unless --all
    assert main(["alerts", "list", "--all", "--json", "--db-url", sqlite_url]) == 0
    assert '"acked_by": "alice"' in capsys.readouterr().out
    assert main(["alerts", "ack", "999", "--db-url", sqlite_url]) == 2
    assert "spectune alerts list" in capsys.readouterr().err
