"""The SQL store on SQLite and PostgreSQL: migrations, the schema check, idempotent ingestion, policies, pins."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
from sqlalchemy import create_engine, inspect

from telemetry.aggregate import aggregate
from telemetry.errors import SchemaOutOfDateError, StoreError, StoreRejectedError
from telemetry.migrate import check, check_migrations, current_revision, downgrade, head_revision, upgrade
from telemetry.records import PolicyTable, RecordError, WindowBatch
from telemetry.schema import VERSION_TABLE, Base
from telemetry.store import Store
from telemetry.synthetic import SyntheticConfig, synthetic_rounds


def _batches(n: int, engine_id: str = "e1", rounds_each: int = 20, seed: int = 0) -> list[WindowBatch]:
    it = synthetic_rounds(n * rounds_each, seed=seed)
    out = []
    for i in range(n):
        rounds = [next(it) for _ in range(rounds_each)]
        agg = aggregate(rounds)
        out.append(WindowBatch(engine_id, 100 + i, float(i), float(i) + 0.25, agg.acceptance, agg.cost,
                               tuple(rounds[:1])))
    return out


def _tables(url: str) -> set[str]:
    eng = create_engine(url)
    try:
        return set(inspect(eng).get_table_names())
    finally:
        eng.dispose()


def test_migrations_upgrade_an_empty_database_and_downgrade_again(db_url: str) -> None:
    assert current_revision(db_url) is None
    upgrade(db_url)
    assert current_revision(db_url) == head_revision() == "0005_scrape_baselines"
    assert _tables(db_url) == set(Base.metadata.tables) | {VERSION_TABLE}
    downgrade(db_url)
    assert current_revision(db_url) is None
    assert _tables(db_url) == {VERSION_TABLE}
    upgrade(db_url)  # and up again: the downgrade left nothing behind that blocks it
    check(db_url)


def test_store_refuses_an_old_schema_and_names_the_upgrade_command(sqlite_url: str) -> None:
    with pytest.raises(SchemaOutOfDateError, match="spectune db upgrade --db-url sqlite:///"):
        Store(sqlite_url)
    with Store(sqlite_url, auto_upgrade=True) as s:
        assert s.batch_count() == 0


def test_password_is_not_echoed_in_errors(pg_admin_url: str) -> None:
    url = "postgresql+psycopg://postgres:s3cret@127.0.0.1:1/none"
    with pytest.raises(StoreError) as e:
        Store(url)
    assert "s3cret" not in str(e.value)


def test_models_and_migrations_agree() -> None:
    check_migrations()


def test_ingest_is_idempotent_and_round_trips(db_url: str) -> None:
    upgrade(db_url)
    batches = _batches(5)
    with Store(db_url) as s:
        assert s.ingest(batches[:3]) == 3
        assert s.ingest(batches) == 2  # the first three are redeliveries
        assert s.ingest(batches + batches) == 0
        assert s.batch_count() == 5
        acc = s.acceptance_windows()
        assert [w.window for w in acc] == [a for b in batches for a in b.acceptance]
        cost = s.cost_windows()
        assert [w.window for w in cost] == [c for b in batches for c in b.cost]
        assert acc[0].engine_id == "e1" and acc[0].window_end == batches[0].window_end
        later = s.acceptance_windows(since_id=acc[9].id)
        assert [w.id for w in later] == [w.id for w in acc[10:]]
        assert len(s.sampled_rounds()) == 5
        assert s.sampled_rounds()[0] == json.loads(json.dumps(asdict(batches[0].sampled_rounds[0])))


def test_a_value_past_its_column_is_refused_on_postgresql_and_nothing_of_the_batch_is_stored(db_url: str) -> None:
    # Counts are 64-bit on the wire; acceptance counts are INTEGER columns. PostgreSQL refuses what does not fit
    # (the binary COPY refuses it before sending); SQLite's INTEGER holds 64 bits.
    upgrade(db_url)
    good, big = _batches(2)
    a = big.acceptance[0]
    huge = replace(a, rows=2**31)  # the store checks no rules: the wire did
    big = replace(big, acceptance=(huge, *big.acceptance[1:]))
    with Store(db_url) as s:
        assert s.ingest([good]) == 1
        if db_url.startswith("postgresql"):
            with pytest.raises(StoreRejectedError, match="out of range"):
                s.ingest([big])
            assert s.batch_count() == 1 and len(s.acceptance_windows()) == len(good.acceptance)
        else:
            assert s.ingest([big]) == 1
            assert s.acceptance_windows()[len(good.acceptance)].window == huge


def test_queries_filter_by_model_pair_and_type(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    b1 = _batches(2)
    it = synthetic_rounds(40, seed=9, config=SyntheticConfig(target_version="t2", draft_version="d2"))
    agg = aggregate(it)
    b2 = WindowBatch("e2", 1, 0.0, 1.0, agg.acceptance, agg.cost)
    with Store(sqlite_url) as s:
        s.ingest([*b1, b2])
        only = s.acceptance_windows(target_version="t2", draft_version="d2")
        assert only and all(w.window.target_version == "t2" for w in only)
        assert len(only) == len(b2.acceptance)
        code = s.acceptance_windows(request_type="code", limit=3)
        assert len(code) == 3 and all(w.window.request_type == "code" for w in code)
        assert len(s.cost_windows(target_version="t2")) == len(b2.cost)


def test_policy_versions(db_url: str) -> None:
    upgrade(db_url)
    with Store(db_url) as s:
        assert s.latest_policy_version() is None
        t1 = PolicyTable(version=1, default_k=3, entries={"t|d|code|8|<=512": 5}, created_at=1.0, reason="first")
        t2 = PolicyTable(version=2, default_k=2, entries={"*|*|*|*|*": 1}, created_at=2.0, reason="second")
        s.save_policy_version(t1)
        s.save_policy_version(t2)
        assert s.latest_policy_version() == t2
        assert s.policy_versions(limit=5) == [t2, t1]
        with pytest.raises(StoreError, match="already exists"):
            s.save_policy_version(t1)


def test_pins(db_url: str) -> None:
    upgrade(db_url)
    with Store(db_url) as s:
        s.pin("t|d|code|8|<=512", 4, "regression on code", who="alice")
        s.pin("t|d|code|8|<=512", 2, "tighter", who="bob")  # replaces the first
        s.pin("*|*|prose|*|*", 0, "prose draft is broken")
        assert [(p.bucket_key, p.k, p.created_by) for p in s.active_pins()] == [
            ("t|d|code|8|<=512", 2, "bob"), ("*|*|prose|*|*", 0, "operator"),
        ]
        assert s.unpin("*|*|prose|*|*") is True
        assert s.unpin("*|*|prose|*|*") is False
        assert [p.k for p in s.active_pins()] == [2]
        with pytest.raises(RecordError):
            s.pin("not-a-key", 1, "x")
        with pytest.raises(RecordError):
            s.pin("t|d|code|8|<=512", 99, "x")


def test_bulk_load_columns_match_the_tables() -> None:
    # Store.ingest_new writes row tuples in these orders, bypassing the ORM: they must name every column but id.
    from telemetry.schema import AcceptanceWindowRow, CostWindowRow, SampledRoundRow
    from telemetry.store import ACCEPTANCE_COLUMNS, COST_COLUMNS, SAMPLED_COLUMNS

    for model, cols in ((AcceptanceWindowRow, ACCEPTANCE_COLUMNS), (CostWindowRow, COST_COLUMNS),
                        (SampledRoundRow, SAMPLED_COLUMNS)):
        assert len(set(cols)) == len(cols)
        assert set(cols) == {c.name for c in model.__table__.columns} - {"id"}


def test_recent_windows_are_the_newest_n_of_each_kind(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    with Store(sqlite_url) as s:
        s.ingest(_batches(4))
        acc, cost = s.acceptance_windows(), s.cost_windows()
        new_acc, new_cost = s.recent_windows(5)
        assert [w.id for w in new_acc] == [w.id for w in acc[-5:]]
        assert [w.id for w in new_cost] == [w.id for w in cost[-5:]]
        everything = s.recent_windows(10_000)
        assert len(everything[0]) == len(acc) and len(everything[1]) == len(cost)


def test_database_failures_are_store_errors_not_sqlalchemy_errors(db_url: str) -> None:
    # Callers catch only the project's errors: a table gone under a running store, and data the database refuses.
    upgrade(db_url)
    with Store(db_url) as s:
        s.ingest(_batches(1))
        eng = create_engine(db_url)
        try:
            with eng.begin() as conn:
                conn.exec_driver_sql("DROP TABLE cost_windows")
        finally:
            eng.dispose()
        with pytest.raises(StoreError, match="reading cost windows failed") as e:
            s.cost_windows()
        assert not isinstance(e.value, StoreRejectedError)
        t = PolicyTable(version=1, default_k=1, created_at=1.0)
        s.save_policy_version(t)
        with pytest.raises(StoreRejectedError, match="already exists"):
            s.save_policy_version(t)
        assert s.acceptance_windows()  # the store still answers after both failures


def test_an_engine_is_registered_once_and_marked_seen_on_each_ingest(db_url: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy import select

    import telemetry.store as store_mod
    from telemetry.schema import EngineRow

    upgrade(db_url)
    with Store(db_url) as s:
        first, second = _batches(2)
        other = _batches(1, engine_id="e2")[0]
        monkeypatch.setattr(store_mod.time, "time", lambda: 100.0)
        assert s.ingest([first, other]) == 2
        monkeypatch.setattr(store_mod.time, "time", lambda: 200.0)
        assert s.ingest([second]) == 1
        with s._session("reading engines") as sess:
            rows = sess.execute(select(EngineRow.engine_id, EngineRow.first_seen_at, EngineRow.last_seen_at)
                                .order_by(EngineRow.engine_id)).all()
    assert [tuple(r) for r in rows] == [("e1", 100.0, 200.0), ("e2", 100.0, 100.0)]
