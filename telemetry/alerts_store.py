"""SQL access to the ``alerts`` table and the model-version registry (``model_versions``), apart from the hot store.

Same database, same conventions as :class:`telemetry.store.Store`: opened by :class:`telemetry.db.Database`,
refuses a schema that is not at head (naming the upgrade command), one context manager owns each transaction and
turns SQLAlchemy's errors into the project's. Kept out of ``Store`` because alerts are rare, operator-facing writes
and ``Store`` is the ingest hot path.

Registry rule: the store registers a (target, draft) pair while ingesting, with ``last_seen_at`` null.
:meth:`AlertStore.claim_version` sets ``last_seen_at`` only where it is still null, in one statement, so exactly
one caller (one sidecar, once) learns that a pair is new, whichever of the store and the registry wrote the row.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import select, update

from telemetry.alerts import Alert
from telemetry.db import Database
from telemetry.errors import SpectuneError
from telemetry.migrate import check
from telemetry.records import MAX_NAME_LEN
from telemetry.schema import REASON_LEN, AlertRow, ModelVersionRow

__all__ = ["AlertNotFoundError", "AlertStore", "ModelVersion"]

Pair = tuple[str, str]  # (target version, draft version)


class AlertNotFoundError(SpectuneError):
    """No alert has the id an operator named."""


@dataclass(frozen=True)
class ModelVersion:
    """A (target, draft) pair as the registry knows it (``last_seen_at`` None: stored, never observed)."""

    target_version: str
    draft_version: str
    first_seen_at: float
    last_seen_at: float | None
    acceptance_windows: int
    cost_windows: int


class AlertStore(Database):
    """Alerts (add, list, ack) and the model-version registry, on the spectune database at ``url``.

    Args:
        url: SQLAlchemy URL, as for :class:`telemetry.store.Store`.

    Raises:
        SchemaOutOfDateError: the database is not at the head revision (run ``spectune db upgrade``).
    """

    def __init__(self, url: str) -> None:
        check(url)
        super().__init__(url)

    # ------------------------------------------------------------------------------------------- alerts
    def add(self, alert: Alert) -> Alert:
        """Store ``alert``; returns it with its id."""
        row = AlertRow(
            kind=alert.kind, bucket=alert.bucket, k=alert.k, target_version=alert.target_version,
            draft_version=alert.draft_version, previous_target_version=alert.previous_target_version,
            previous_draft_version=alert.previous_draft_version, affected=list(alert.affected),
            statistic=alert.statistic, stat_before=alert.before, before_count=alert.before_count,
            stat_after=alert.after, after_count=alert.after_count, count_unit=alert.count_unit,
            detector=None if alert.detector is None else alert.detector[:REASON_LEN],
            change_at=alert.change_at, detected_at=alert.detected_at, message=alert.message, extra=alert.extra,
            acked_at=alert.acked_at, acked_by=alert.acked_by,
        )
        with self._session("storing an alert") as s:
            s.add(row)
            s.flush()
            return alert.with_id(int(row.id))

    def list_alerts(self, limit: int = 50, *, unacked_only: bool = False, kind: str | None = None) -> list[Alert]:
        """The newest ``limit`` alerts, newest first."""
        q = select(AlertRow).order_by(AlertRow.id.desc()).limit(limit)
        if unacked_only:
            q = q.where(AlertRow.acked_at.is_(None))
        if kind is not None:
            q = q.where(AlertRow.kind == kind)
        with self._session("reading alerts") as s:
            return [_alert(r) for r in s.scalars(q)]

    def get(self, alert_id: int) -> Alert | None:
        with self._session("reading an alert") as s:
            r = s.get(AlertRow, alert_id)
            return None if r is None else _alert(r)

    def ack(self, alert_id: int, who: str = "operator") -> Alert:
        """Acknowledge an alert (acking twice keeps the first ack). Returns the alert as stored.

        Raises:
            AlertNotFoundError: no alert has this id (``spectune alerts list`` shows the ids).
        """
        who = who[:MAX_NAME_LEN]
        with self._session("acking an alert") as s:
            s.execute(update(AlertRow).where(AlertRow.id == alert_id, AlertRow.acked_at.is_(None))
                      .values(acked_at=time.time(), acked_by=who))
            r = s.get(AlertRow, alert_id)
            if r is None:
                raise AlertNotFoundError(f"no alert has id {alert_id}; `spectune alerts list` shows the ids")
            return _alert(r)

    def acked_same_change(self, alert: Alert, rel_tol: float) -> Alert | None:
        """An acked alert that reported the same change as ``alert``, or None.

        Same change: a model update of the same old and new pairs; a drift of the same kind, bucket, k and
        direction whose level after the change is within ``rel_tol`` (relative) of this one's. A detector
        that fires again on a change an operator already acknowledged (after a restart replays the windows, or
        after its window shrank) is then not raised again.
        """
        a = AlertRow
        q = select(a).where(a.kind == alert.kind, a.bucket == alert.bucket, a.acked_at.is_not(None))
        with self._session("reading acked alerts") as s:
            for r in s.scalars(q.order_by(a.id.desc()).limit(100)):
                if _same_change(_alert(r), alert, rel_tol):
                    return _alert(r)
        return None

    # ---------------------------------------------------------------------------------------- registry
    def claim_version(self, pair: Pair, now: float) -> bool:
        """Mark ``pair`` observed; True for exactly one caller ever (the one that should raise ``model_update``)."""
        m = ModelVersionRow
        with self._session("registering a model version") as s:
            ins = self._insert(m)
            s.execute(ins.values(target_version=pair[0], draft_version=pair[1], first_seen_at=now)
                      .on_conflict_do_nothing(index_elements=["target_version", "draft_version"]))
            res = s.execute(update(m).where(m.target_version == pair[0], m.draft_version == pair[1],
                                            m.last_seen_at.is_(None)).values(last_seen_at=now))
            return bool(getattr(res, "rowcount", 0))

    def touch_versions(self, windows: Mapping[Pair, tuple[int, int]], now: float) -> None:
        """Add (acceptance, cost) window counts to each pair and move its ``last_seen_at`` to ``now``."""
        m = ModelVersionRow
        with self._session("updating model versions") as s:
            for (t, d), (n_acc, n_cost) in sorted(windows.items()):
                s.execute(update(m).where(m.target_version == t, m.draft_version == d).values(
                    last_seen_at=now, acceptance_windows=m.acceptance_windows + n_acc,
                    cost_windows=m.cost_windows + n_cost))

    def model_versions(self) -> list[ModelVersion]:
        """Every pair, the most recently seen first (pairs never observed by the registry last)."""
        m = ModelVersionRow
        with self._session("reading model versions") as s:
            rows = s.scalars(select(m).order_by(m.last_seen_at.is_(None), m.last_seen_at.desc(), m.id.desc()))
            return [ModelVersion(r.target_version, r.draft_version, r.first_seen_at, r.last_seen_at,
                                 int(r.acceptance_windows), int(r.cost_windows)) for r in rows]


def _same_change(old: Alert, new: Alert, rel_tol: float) -> bool:
    if old.kind != new.kind or old.bucket != new.bucket or old.k != new.k:
        return False
    if old.before is None or new.after is None or old.after is None:  # model update: same old and new pairs
        return (old.previous_target_version, old.previous_draft_version) == (
            new.previous_target_version, new.previous_draft_version)
    return old.direction == new.direction and abs(new.after - old.after) <= rel_tol * abs(old.after)


def _alert(r: AlertRow) -> Alert:
    return Alert(
        id=int(r.id), kind=r.kind, bucket=r.bucket, k=r.k, target_version=r.target_version,
        draft_version=r.draft_version, previous_target_version=r.previous_target_version,
        previous_draft_version=r.previous_draft_version, affected=tuple(r.affected), statistic=r.statistic,
        before=r.stat_before, before_count=int(r.before_count), after=r.stat_after, after_count=int(r.after_count),
        count_unit=r.count_unit, detector=r.detector, change_at=r.change_at, detected_at=r.detected_at,
        message=r.message, extra=dict(r.extra), acked_at=r.acked_at, acked_by=r.acked_by,
    )
