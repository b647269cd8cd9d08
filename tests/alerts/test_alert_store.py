"""Alerts and the model-version registry on the real databases (SQLite and PostgreSQL): stored, listed, acked,
streamed; one ``model_update`` per new pair, across restarts; an acked change is not raised again."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import redis
from alert_synth import acceptance_hists, acceptance_window

from controller.service.alerts import AlertConfig, AlertManager, PrometheusSink, RedisStreamSink
from telemetry.aggregate import aggregate
from telemetry.alerts import ACCEPTANCE_DRIFT, MODEL_UPDATE, Alert, alert_from_json
from telemetry.alerts_store import AlertNotFoundError, AlertStore
from telemetry.migrate import downgrade, upgrade
from telemetry.records import WindowBatch
from telemetry.store import Store
from telemetry.synthetic import SyntheticConfig, synthetic_rounds

K = 4


def _batch(seq: int, target: str = "target-v1", draft: str = "draft-v1", at: float | None = None) -> WindowBatch:
    rounds = list(synthetic_rounds(5, seed=seq, config=SyntheticConfig(target_version=target, draft_version=draft)))
    agg = aggregate(rounds)
    t = float(seq) if at is None else at
    return WindowBatch("e1", seq, t, t + 0.25, agg.acceptance, agg.cost)


def _drift_alert(**kw: object) -> Alert:
    base: dict[str, object] = dict(
        kind=ACCEPTANCE_DRIFT, bucket="t1|d1|structured|*|<=512", k=4, target_version="t1", draft_version="d1",
        detected_at=100.0, change_at=90.0, statistic="acceptance_rate", before=0.6, before_count=3000, after=0.45,
        after_count=250, count_unit="rows", detector="adwin(clock=16, delta=0.001)", message="fell",
    )
    base.update(kw)
    return Alert(**base)  # type: ignore[arg-type]


def test_an_alert_is_stored_listed_and_acked(db_url: str) -> None:
    upgrade(db_url)
    with AlertStore(db_url) as st:
        a = st.add(_drift_alert())
        assert a.id is not None
        assert st.list_alerts() == [a]
        acked = st.ack(a.id, who="alice")
        assert acked.acked_by == "alice" and acked.acked_at is not None
        assert st.ack(a.id, who="bob").acked_by == "alice"  # the first ack stands
        assert st.list_alerts(unacked_only=True) == []
        with pytest.raises(AlertNotFoundError, match="spectune alerts list"):
            st.ack(a.id + 100)


def test_an_alert_is_stored_streamed_counted_and_acked_end_to_end(
    db_url: str, redis_url: str, redis_prefix: str
) -> None:
    upgrade(db_url)
    stream = RedisStreamSink(redis_url, redis_prefix)
    prom = PrometheusSink()
    with AlertStore(db_url) as st:
        m = AlertManager(store=st, sinks=[stream, prom])
        rng = np.random.default_rng(4)
        hists = np.concatenate([acceptance_hists(rng, 300, 10, K, 0.8), acceptance_hists(rng, 100, 10, K, 0.6)])
        raised = [a for i, h in enumerate(hists) if (a := m.observe_acceptance(acceptance_window(h, K), float(i)))]
        assert len(raised) == 1 and raised[0].id is not None
        stored = st.list_alerts()
        assert stored == raised
        entries: list[Any] = redis.Redis.from_url(redis_url).xrange(f"{redis_prefix}:alerts")  # type: ignore[assignment]
        assert len(entries) == 1
        assert alert_from_json(json.loads(entries[0][1][b"v"])) == raised[0]
        assert prom.registry.get_sample_value("spectune_alerts_total", {"kind": ACCEPTANCE_DRIFT}) == 1.0
        assert prom.registry.get_sample_value("spectune_alerts_total", {"kind": MODEL_UPDATE}) == 0.0
        st.ack(stored[0].id or 0)
        m.close()


def test_an_acked_change_is_not_raised_again_after_a_restart(db_url: str) -> None:
    upgrade(db_url)
    rng = np.random.default_rng(5)
    hists = np.concatenate([acceptance_hists(rng, 300, 10, K, 0.8), acceptance_hists(rng, 100, 10, K, 0.6)])
    with AlertStore(db_url) as st:
        m1 = AlertManager(store=st)
        first = [a for i, h in enumerate(hists) if (a := m1.observe_acceptance(acceptance_window(h, K), float(i)))]
        assert len(first) == 1
        st.ack(first[0].id or 0)
        m2 = AlertManager(store=st)  # a restarted sidecar replays the same windows
        again = [a for i, h in enumerate(hists) if (a := m2.observe_acceptance(acceptance_window(h, K), float(i)))]
        assert again == []
        assert m2.stats["suppressed_acked"] == 1
        assert len(st.list_alerts()) == 1


def test_model_update_is_raised_once_per_new_pair(db_url: str) -> None:
    upgrade(db_url)
    with Store(db_url) as store, AlertStore(db_url) as st:
        m = AlertManager(store=st)
        raised: list[Alert] = []
        for seq in range(3):  # the first pair of a fresh deployment is no update
            b = _batch(seq)
            store.ingest([b])  # the store registers the pair first, as the sidecar does
            raised += m.observe_batch(b)
        assert [a.kind for a in raised] == []
        for seq in range(3, 6):
            b = _batch(seq, target="target-v2")
            store.ingest([b])
            raised += m.observe_batch(b)
        ups = [a for a in raised if a.kind == MODEL_UPDATE]
        assert len(ups) == 1
        u = ups[0]
        assert (u.previous_target_version, u.previous_draft_version) == ("target-v1", "draft-v1")
        assert (u.target_version, u.draft_version) == ("target-v2", "draft-v1")
        assert u.affected and all(b.startswith("target-v2|draft-v1|") for b in u.affected)
        m.close()
        # A restarted sidecar (or a second one) knows the pair: no second alert.
        m2 = AlertManager(store=st)
        assert m2.observe_batch(_batch(6, target="target-v2")) == []
        m2.close()
        versions = {(v.target_version, v.draft_version): v for v in st.model_versions()}
        v1, v2 = versions[("target-v1", "draft-v1")], versions[("target-v2", "draft-v1")]
        assert v1.acceptance_windows > 0 and v1.cost_windows > 0
        assert v2.last_seen_at is not None and v1.last_seen_at is not None and v2.last_seen_at > v1.last_seen_at
        assert [a.kind for a in st.list_alerts()] == [MODEL_UPDATE]


def test_cooldown_turns_a_flapping_signal_into_one_alert() -> None:
    m = AlertManager(AlertConfig(cooldown_s=10_000.0))
    rng = np.random.default_rng(6)
    parts = [acceptance_hists(rng, 200, 10, K, alpha) for alpha in (0.8, 0.6, 0.8, 0.6, 0.8, 0.6)]
    raised = [a for i, h in enumerate(np.concatenate(parts))
              if (a := m.observe_acceptance(acceptance_window(h, K), float(i)))]
    assert len(raised) == 1
    assert m.stats["detections_acceptance_drift"] >= 3 and m.stats["suppressed_cooldown"] >= 2


def test_migration_0003_upgrades_and_downgrades(sqlite_url: str) -> None:
    upgrade(sqlite_url, "0002_policy_version_bigint")
    upgrade(sqlite_url)
    with AlertStore(sqlite_url) as st:
        st.add(_drift_alert())
    downgrade(sqlite_url, "0002_policy_version_bigint")
    upgrade(sqlite_url)
    with AlertStore(sqlite_url) as st:
        assert st.list_alerts() == []
