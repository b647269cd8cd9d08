"""The sidecar's settings: how often it decides, what it replays at start-up, what it caps."""

from __future__ import annotations

from dataclasses import dataclass, field

from telemetry.cardinality import CardinalityLimits
from telemetry.ingest import ConsumerConfig
from telemetry.window_feed import WindowFeedConfig


@dataclass(frozen=True)
class SidecarConfig:
    """How often the sidecar decides, and what it replays at start-up."""

    publish_every_windows: int = 16  # decide after this many new windows ...
    publish_every_s: float = 1.0  # ... or this many seconds (also how soon a pin made in SQL takes effect)
    warm_start_windows: int = 20_000  # newest stored windows replayed into the policy at start-up (0 = cold)
    max_table_buckets: int = 4096  # cap on exact entries in a table (versions x types x batch x context)
    # A bucket explores only while its cell (versions, batch bucket, context bucket) has traffic: a cost window
    # within the last this-many decisions. Other buckets get the policy's current best without exploration (no
    # rows there to measure a probe, and probing them only churns the table: after a model update the old
    # version's cells would be probed at k=0 and the default k would follow them).
    explore_active_decisions: int = 3
    consumer: ConsumerConfig = field(default_factory=ConsumerConfig)
    # Caps on the request types, buckets and version pairs tracked: windows beyond them are dead-lettered with a
    # reason (telemetry.cardinality), so forged labels cannot grow the policy or the decision time without end.
    limits: CardinalityLimits = field(default_factory=CardinalityLimits)
    # With a lease, how the policy tails the store for the windows every consumer committed.
    feed: WindowFeedConfig = field(default_factory=WindowFeedConfig)
    # A decision stops deciding buckets after this many seconds; the buckets it did not reach keep their last k
    # and go first at the next decision. It must stay well inside the leader lease (renewed between steps), so
    # that no flood of labels can make a decision outlast the lease and stop publishing.
    decide_budget_s: float = 0.5
    # How often the windows stream is trimmed below what every consumer group acknowledged, and the streams'
    # lengths read for health.
    trim_every_s: float = 5.0
    # /health says degraded while more windows than this wait in the stream undelivered (a backlog nobody reads).
    stream_backlog_degraded: int = 100_000

    def __post_init__(self) -> None:
        if self.publish_every_windows < 1:
            raise ValueError(f"SidecarConfig.publish_every_windows must be >= 1, got {self.publish_every_windows}")
        if self.publish_every_s <= 0:
            raise ValueError(f"SidecarConfig.publish_every_s must be > 0, got {self.publish_every_s}")
        if not 0 < self.decide_budget_s <= 60 or not self.trim_every_s > 0 or self.stream_backlog_degraded < 1:
            raise ValueError("SidecarConfig needs 0 < decide_budget_s <= 60, trim_every_s > 0 and "
                             "stream_backlog_degraded >= 1")
        if self.warm_start_windows < 0 or self.max_table_buckets < 1 or self.explore_active_decisions < 1:
            raise ValueError("SidecarConfig needs warm_start_windows >= 0, max_table_buckets >= 1 and "
                             "explore_active_decisions >= 1")
