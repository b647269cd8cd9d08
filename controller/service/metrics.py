"""The sidecar's Prometheus metrics, defined once, on a registry of their own.

Each :class:`SidecarMetrics` owns a fresh :class:`~prometheus_client.CollectorRegistry` (never the global one), so
a test or a benchmark can run several sidecars in one process and each ``GET /metrics`` shows only its own.

Spec-decode series are named after vLLM's ``vllm:spec_decode_*`` counters so its Grafana panels carry over with a
prefix change (``vllm:`` -> ``spectune_``), with the same conventions:

- ``spectune_spec_decode_num_drafts_total``: rows that drafted (k > 0), one per row per round (vLLM: one per
  sequence per step with a draft).
- ``spectune_spec_decode_num_draft_tokens_total``: draft tokens proposed (sum of k over those rows).
- ``spectune_spec_decode_num_accepted_tokens_total``: draft tokens the target kept; **excludes** the bonus token,
  as vLLM's counter does.
- ``spectune_spec_decode_num_accepted_tokens_per_pos_total{position=i}``: rows whose draft token at 0-based
  position ``i`` was kept (the acceptance curve, unnormalised).
- ``spectune_mean_acceptance_length``: emitted tokens per drafting row, **including** the bonus token (vLLM's
  "mean acceptance length" = 1 + accepted / drafts), cumulative per bucket.

Labels are the acceptance bucket: ``target_version``, ``draft_version``, ``request_type``, ``context_bucket``.
"""

from __future__ import annotations

import contextlib
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from telemetry.records import MAX_DRAFT_LEN, WILDCARD, AcceptanceWindow
from telemetry.wire import parse_bucket_key

ACCEPTANCE_LABELS = ("target_version", "draft_version", "request_type", "context_bucket")
BUCKET_LABELS = ("target_version", "draft_version", "request_type", "batch_bucket", "context_bucket")
# Decision latency spans a dict lookup (cached) to a full table recompute (tens of ms for many buckets).
DEGRADED_REASONS = ("transport", "store", "publisher", "decision_overdue", "lease_churn", "label_caps",
                    "stream_backlog")
DECISION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class SidecarMetrics:
    """Every series one sidecar exports. Consumers call the ``on_*`` methods; nothing else touches the series.

    Args:
        registry: where to register; a fresh private registry by default.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._expo_lock = threading.Lock()
        self._expo: tuple[float, bytes] | None = None  # (monotonic time, body) of the last rendering
        r = self.registry
        self.windows_ingested = Counter(
            "spectune_windows_ingested", "Window batches newly stored (redeliveries excluded).", registry=r)
        self.windows_observed = Counter(
            "spectune_windows_observed", "Acceptance and cost windows fed to the policy.", ["kind"], registry=r)
        self.records_rejected = Counter(
            "spectune_records_rejected", "Entries or windows rejected, by reason (kept in the dead-letter stream).",
            ["reason"], registry=r)
        self.policy_version = Gauge("spectune_policy_version", "Version of the policy table last published.",
                                    registry=r)
        self.policy_publishes = Counter("spectune_policy_publishes", "Policy versions published.", registry=r)
        self.policy_version_ahead = Counter(
            "spectune_policy_version_ahead",
            "Tables found at the engines' key with a version ahead of the store (forged or another deployment's); "
            "reported and replaced, never adopted.", registry=r)
        self.chosen_k = Gauge("spectune_chosen_k", "k in the published policy table, per bucket (0 = off).",
                              list(BUCKET_LABELS), registry=r)
        self.num_drafts = Counter(
            "spectune_spec_decode_num_drafts", "Rows that drafted (k > 0), one per row per round.",
            list(ACCEPTANCE_LABELS), registry=r)
        self.num_draft_tokens = Counter(
            "spectune_spec_decode_num_draft_tokens", "Draft tokens proposed.", list(ACCEPTANCE_LABELS), registry=r)
        self.num_accepted_tokens = Counter(
            "spectune_spec_decode_num_accepted_tokens", "Draft tokens accepted (bonus token excluded, as vLLM).",
            list(ACCEPTANCE_LABELS), registry=r)
        self.num_accepted_tokens_per_pos = Counter(
            "spectune_spec_decode_num_accepted_tokens_per_pos", "Rows whose draft at 0-based position was kept.",
            [*ACCEPTANCE_LABELS, "position"], registry=r)
        self.acceptance_rate = Gauge(
            "spectune_acceptance_rate", "Accepted / drafted tokens, cumulative per bucket.",
            list(ACCEPTANCE_LABELS), registry=r)
        self.mean_acceptance_length = Gauge(
            "spectune_mean_acceptance_length", "Emitted tokens per drafting row (bonus token included).",
            list(ACCEPTANCE_LABELS), registry=r)
        self.decision_seconds = Histogram(
            "spectune_decision_seconds", "Seconds to compute a policy table from the policy.",
            buckets=DECISION_BUCKETS_S, registry=r)
        self.http_bad_requests = Counter(
            "spectune_http_bad_requests", "Operator HTTP requests refused with 400, by reason.", ["reason"],
            registry=r)
        self.http_client_disconnects = Counter(
            "spectune_http_client_disconnects",
            "Operator HTTP connections the client reset or abandoned mid-request (not sidecar errors).", registry=r)
        self.http_overloaded = Counter(
            "spectune_http_overloaded", "Operator HTTP requests answered 503 because every worker was busy.",
            registry=r)
        self.http_requests_timed_out = Counter(
            "spectune_http_requests_timed_out",
            "Operator HTTP requests cut because they were not whole request_timeout_s after their first byte "
            "(half-sent or trickled).", registry=r)
        self.leader = Gauge(
            "spectune_sidecar_leader",
            "1 while this sidecar holds the leader lease and so decides and publishes the table (always 1 without "
            "a lease: a single sidecar); 0 while it only ingests.", registry=r)
        self.lease_events = Counter(
            "spectune_sidecar_lease_events",
            "Leader lease transitions of this sidecar: acquired, or lost (lapsed, taken over, Redis unreachable; "
            "a clean release is not a loss).", ["event"], registry=r)
        self.decision_deferred = Gauge(
            "spectune_decision_deferred_buckets",
            "Buckets the last decision did not reach within its time budget (they kept their k and go first next).",
            registry=r)
        self.labels_evicted = Counter(
            "spectune_labels_evicted",
            "Request types / version pairs evicted from the label caps by a label with more evidence.", ["kind"],
            registry=r)
        self.stream_entries = Gauge(
            "spectune_stream_entries", "Entries held in each Redis stream, as of the last trim.", ["stream"],
            registry=r)
        self.stream_trimmed = Counter(
            "spectune_stream_trimmed_entries",
            "Windows-stream entries trimmed after every consumer group acknowledged (stored) them.", registry=r)
        self.degraded = Gauge(
            "spectune_sidecar_degraded",
            "1 while /health is degraded for this reason: transport, store, publisher, decision_overdue (the leader "
            "took no due decision within 2 intervals + 1 s), lease_churn (3 lease losses within 5 minutes), "
            "label_caps (a cap refused windows within 60 s), stream_backlog.", ["reason"], registry=r)
        # label tuple -> [rows that drafted, drafted, accepted, emitted]: the gauges are ratios of these totals
        self._totals: dict[tuple[str, ...], list[int]] = {}

    def on_acceptance(self, w: AcceptanceWindow) -> None:
        """Count one acceptance window into the spec-decode series (speculation-off windows count no drafts)."""
        self.windows_observed.labels("acceptance").inc()
        if w.k == 0 or w.rows == 0:
            return
        labels = (w.target_version, w.draft_version, w.request_type, w.context_bucket)
        self.num_drafts.labels(*labels).inc(w.rows)
        self.num_draft_tokens.labels(*labels).inc(w.drafted)
        self.num_accepted_tokens.labels(*labels).inc(w.accepted)
        tail = 0
        for i in range(w.k, 0, -1):  # rows with accepted >= i kept the draft at position i - 1
            tail += w.hist[i]
            if tail:
                self.num_accepted_tokens_per_pos.labels(*labels, str(i - 1)).inc(tail)
        t = self._totals.setdefault(labels, [0, 0, 0, 0])
        t[0] += w.rows
        t[1] += w.drafted
        t[2] += w.accepted
        t[3] += w.emitted
        self.acceptance_rate.labels(*labels).set(t[2] / t[1] if t[1] else 0.0)
        self.mean_acceptance_length.labels(*labels).set(t[3] / t[0])

    def forget_request_type(self, rtype: str) -> None:
        """Drop the spec-decode series of a request type the sidecar no longer tracks (evicted from the caps)."""
        for labels in [labels for labels in self._totals if labels[2] == rtype]:
            del self._totals[labels]
            for series in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.acceptance_rate,
                           self.mean_acceptance_length):
                with contextlib.suppress(KeyError):
                    series.remove(*labels)
            for pos in range(MAX_DRAFT_LEN):
                with contextlib.suppress(KeyError):
                    self.num_accepted_tokens_per_pos.remove(*labels, str(pos))

    def on_decision(self, seconds: float, deferred: int) -> None:
        self.decision_seconds.observe(seconds)
        self.decision_deferred.set(deferred)

    def on_label_evicted(self, kind: str) -> None:
        self.labels_evicted.labels(kind).inc()

    def on_streams(self, trimmed: int, lengths: dict[str, int]) -> None:
        if trimmed > 0:
            self.stream_trimmed.inc(trimmed)
        for stream, n in lengths.items():
            self.stream_entries.labels(stream).set(n)

    def on_degraded(self, reasons: list[str]) -> None:
        for reason in DEGRADED_REASONS:
            self.degraded.labels(reason).set(1 if reason in reasons else 0)

    def on_cost(self) -> None:
        self.windows_observed.labels("cost").inc()

    def on_rejected(self, reason: str, n: int = 1) -> None:
        if n > 0:
            self.records_rejected.labels(reason).inc(n)

    def on_http_overloaded(self) -> None:
        self.http_overloaded.inc()

    def on_http_request_timed_out(self) -> None:
        self.http_requests_timed_out.inc()

    def on_http_client_gone(self) -> None:
        self.http_client_disconnects.inc()

    def on_version_ahead(self) -> None:
        self.policy_version_ahead.inc()

    def on_leadership(self, leader: bool, *, changed: bool) -> None:
        """Whether this sidecar leads now; ``changed``: it just acquired (leader) or lost (not) the lease."""
        self.leader.set(1 if leader else 0)
        if changed:
            self.lease_events.labels("acquired" if leader else "lost").inc()

    def on_published(self, version: int, entries: dict[str, int]) -> None:
        """A new table went out: its version, and k per exact bucket (wildcard keys are not exported)."""
        self.policy_publishes.inc()
        self.policy_version.set(version)
        self.chosen_k.clear()  # buckets absent from the new table must not linger with an old k
        for key, k in entries.items():
            t, d, r, bb, c = parse_bucket_key(key)
            if bb is None or WILDCARD in (t, d, r, c):
                continue
            self.chosen_k.labels(t, d, r, str(bb), c).set(k)

    def exposition(self, max_age_s: float = 0.0) -> bytes:
        """The text exposition format of this registry (what ``GET /metrics`` serves).

        Args:
            max_age_s: a rendering at most this old may be served again (0: render now). Rendering takes
                milliseconds of the sidecar's GIL; several scrapers, or a scraper retrying, share one per period.
        """
        now = time.monotonic()
        with self._expo_lock:
            if max_age_s > 0 and self._expo is not None and now - self._expo[0] <= max_age_s:
                return self._expo[1]
            body = generate_latest(self.registry)
            self._expo = (now, body)
            return body
