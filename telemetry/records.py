"""The shared vocabulary of spectune: what the engine observes, what travels, and the policy table.

Data and nothing else: the records, their conventions and the constants they are bounded by. How they travel
and the rule for each field are in :mod:`telemetry.wire`; the policy table's lookup, JSON form and caps are in
:mod:`telemetry.policy_table`. Imports nothing heavy (no torch, no Redis, no SQL): the engine, the sidecar, the
store and the policies all read these definitions, and the sidecar must run on a machine without torch.

Conventions (defined here, once):

- A **round** is one draft-then-verify step over the engine's current batch; a **row** is one sequence in it.
- ``k`` is a row's draft length in a round; ``k == 0`` means speculation is off for that row (plain decoding).
- ``accepted`` is the number of the row's draft tokens the target kept, ``0 <= accepted <= k``.
- ``emitted = accepted + 1``: the accepted drafts plus the bonus (all accepted) or correction (first rejection)
  token. **Acceptance length is ``emitted``** — it counts the bonus token, as vLLM's
  ``vllm:spec_decode_num_accepted_tokens`` / mean acceptance length do. A finished row may emit fewer (EOS or
  max tokens reached mid-draft); ``emitted`` is then what was actually kept.
- ``tokens_verified`` of a round is the number of tokens the target's token-wise layers processed. Verification
  is packed (as in a flattened-batch engine): the sum over rows of ``k + 1``, between ``batch_size`` (every row
  at k = 0) and ``batch_size * (max_k + 1)`` (every row at max_k).
- Acceptance is a property of a **row**, keyed by (versions, request type, context bucket, k); cost is a
  property of a **round**, keyed by (versions, batch-size bucket, context bucket, largest k). They are learned
  separately.
- **goodput** = emitted tokens per second of wall time, for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from telemetry.errors import CountableError

SCHEMA_VERSION = 1  # bump when a travelling record changes shape; receivers reject unknown versions
MAX_DRAFT_LEN = 16  # verify cost grows with k + 1; no useful policy drafts further on any engine we know
MAX_ENCODED_BYTES = 1 << 20  # size cap of one encoded window batch; larger payloads are rejected unread
MAX_NAME_LEN = 64  # request types, version ids and engine ids are short labels
WILDCARD = "*"  # a bucket key part that matches anything (pins and table entries)
MIN_BATCH_BUCKET = 1  # a batch holds at least one row; batch buckets are upper edges, so >= 1 too
REQUEST_TYPES = ("code", "prose", "structured")  # the reference workloads; others are allowed on the wire
DEFAULT_BATCH_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # powers of two, as engines size CUDA graphs
DEFAULT_CONTEXT_EDGES = (512, 2048, 8192)  # <=512, <=2k, <=8k, >8k


class RecordError(CountableError):
    """A record failed validation. ``reason`` is a short, countable label (e.g. ``accepted_gt_drafted``)."""


# --------------------------------------------------------------------------------------------------- buckets
@dataclass(frozen=True)
class BucketConfig:
    """Bucket edges. Configuration, not code: engines and the sidecar must agree on them."""

    batch_edges: tuple[int, ...] = DEFAULT_BATCH_EDGES  # upper edges; larger batches fall in the last bucket
    context_edges: tuple[int, ...] = DEFAULT_CONTEXT_EDGES  # upper edges in tokens; beyond is one more bucket

    def __post_init__(self) -> None:
        for name in ("batch_edges", "context_edges"):
            edges = getattr(self, name)
            if not edges or any(e <= 0 for e in edges) or list(edges) != sorted(set(edges)):
                raise ValueError(f"BucketConfig.{name} must be strictly increasing positive ints, got {edges}")

    def batch_bucket(self, batch_size: int) -> int:
        """The smallest edge >= batch_size (the last edge for anything larger)."""
        for e in self.batch_edges:
            if batch_size <= e:
                return e
        return self.batch_edges[-1]

    def context_bucket(self, context_len: int) -> str:
        """``"<=512"``, ``"<=2048"``, ... or ``">8192"``."""
        for e in self.context_edges:
            if context_len <= e:
                return f"<={e}"
        return f">{self.context_edges[-1]}"

    def context_labels(self) -> list[str]:
        return [f"<={e}" for e in self.context_edges] + [f">{self.context_edges[-1]}"]


DEFAULT_BUCKETS = BucketConfig()


class Cell(NamedTuple):
    """A cost cell: (versions, batch-size bucket, context bucket). Cost is learnt per cell, and the request types
    of a cell share its batches, so a policy chooses their ks together."""

    target_version: str
    draft_version: str
    batch_bucket: int
    context_bucket: str


def context_length(label: str, default: int = 512) -> int:
    """A representative context length in tokens for a context-bucket label as :meth:`BucketConfig.context_bucket`
    writes them (``"<=512"`` -> 512, ``">8192"`` -> 16384); ``default`` for a label of another grammar."""
    try:
        if label.startswith("<="):
            return max(1, int(label[2:]))
        if label.startswith(">"):
            return max(1, 2 * int(label[1:]))
    except ValueError:
        pass
    return default


@dataclass(frozen=True)
class Bucket:
    """What a decision is made for: (versions, request type, batch-size bucket, context bucket)."""

    target_version: str
    draft_version: str
    request_type: str
    batch_bucket: int
    context_bucket: str

    @property
    def cell(self) -> Cell:
        """The bucket's cost cell."""
        return Cell(self.target_version, self.draft_version, self.batch_bucket, self.context_bucket)

    def key(self) -> str:
        """``target|draft|request type|batch bucket|context bucket``; ``telemetry.wire.parse_bucket`` reads it."""
        return "|".join(
            (self.target_version, self.draft_version, self.request_type, str(self.batch_bucket), self.context_bucket)
        )


# ------------------------------------------------------------------------------------------ engine records
@dataclass(frozen=True)
class RowRecord:
    """One row in one round: a unit of acceptance."""

    request_type: str
    context_len: int  # tokens in the row's context before this round (prompt + generated so far)
    k: int  # draft length used for this row this round (0 = off)
    accepted: int  # drafts kept, 0..k
    emitted: int  # tokens appended this round (accepted + 1, fewer only when the row finished mid-round)


@dataclass(frozen=True)
class RoundRecord:
    """One round of the engine: a unit of cost, with its rows. Returned by the engine, never logged by it."""

    round_index: int
    batch_size: int
    max_k: int  # largest k in the batch: the draft runs this many steps, verify scores max_k + 1 positions
    tokens_verified: int  # packed: sum over rows of k + 1
    draft_s: float  # seconds drafting (device time on CUDA, perf_counter on CPU)
    verify_s: float  # seconds in the target's verify forward and the acceptance rule
    other_s: float  # the rest of the round's decode work (policy lookups, bookkeeping)
    target_version: str
    draft_version: str
    rows: tuple[RowRecord, ...]
    timestamp: float = 0.0  # wall-clock seconds (time.time()) at the end of the round
    # Admitting new requests before the round (the target's prefill of their prompts). Each request is prefilled
    # once whatever k is, so it is kept apart: cost windows and the policies see draft/verify/other only (a round
    # that happened to admit a few prompts would otherwise make its k look dear), latency and wall_s include it.
    prefill_s: float = 0.0
    # False: the round's rows count (acceptance, drift) but its seconds teach no cost: cost windows leave the round
    # out, its latencies with it. For an engine that runs prompt tokens and decoding rows in one forward and can
    # only estimate the prompt's part (vLLM's mixed steps): on ``bench vllm`` such steps came out at 0.2-1.9x the
    # decode-only steps of the same rows and k, so whichever k ran during a burst of new prompts was mis-costed.
    costed: bool = True

    @property
    def wall_s(self) -> float:
        return self.draft_s + self.verify_s + self.other_s + self.prefill_s

    @property
    def emitted(self) -> int:
        return sum(r.emitted for r in self.rows)

    @property
    def max_context(self) -> int:
        return max((r.context_len for r in self.rows), default=0)


# --------------------------------------------------------------------------------------- travelling windows
@dataclass(frozen=True)
class Stat:
    """count / sum / sum of squares / max of a non-negative quantity (mergeable)."""

    count: int = 0
    total: float = 0.0
    sumsq: float = 0.0
    max: float = 0.0

    def add(self, x: float) -> Stat:
        return Stat(self.count + 1, self.total + x, self.sumsq + x * x, max(self.max, x))

    def merge(self, o: Stat) -> Stat:
        return Stat(self.count + o.count, self.total + o.total, self.sumsq + o.sumsq, max(self.max, o.max))

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass(frozen=True)
class AcceptanceWindow:
    """Acceptance aggregated over a window for one (versions, request type, context bucket, k).

    ``hist[i]`` counts rows that accepted exactly ``i`` drafts (``len(hist) == k + 1``), so the per-position
    acceptance curve P(accepted >= i | k) can be derived. ``emitted`` counts the bonus token (see module doc).
    """

    target_version: str
    draft_version: str
    request_type: str
    context_bucket: str
    k: int
    rows: int
    drafted: int  # rows * k
    accepted: int
    emitted: int
    hist: tuple[int, ...]

    @property
    def mean_acceptance_length(self) -> float:
        return self.emitted / self.rows if self.rows else 0.0

    def acceptance_curve(self) -> list[float]:
        """P(accepted >= i | k) for i = 1..k."""
        if not self.rows:
            return [0.0] * self.k
        tail, out = 0, []
        for i in range(self.k, 0, -1):
            tail += self.hist[i]
            out.append(tail / self.rows)
        return out[::-1]


@dataclass(frozen=True)
class CostWindow:
    """Cost aggregated over a window for one (versions, batch-size bucket, context bucket, largest k)."""

    target_version: str
    draft_version: str
    batch_bucket: int
    context_bucket: str
    max_k: int
    rounds: int
    tokens_verified: int
    emitted: int  # tokens emitted by these rounds (goodput numerator)
    batch_rows: int  # sum of batch sizes over the rounds (mean batch size = batch_rows / rounds)
    draft_s: Stat
    verify_s: Stat
    other_s: Stat
    latency_p50: float  # per-token latency (round wall seconds / tokens a row emitted), percentiles in window
    latency_p95: float
    latency_p99: float

    @property
    def cell(self) -> Cell:
        """The cost cell these rounds ran in."""
        return Cell(self.target_version, self.draft_version, self.batch_bucket, self.context_bucket)


@dataclass(frozen=True)
class WindowBatch:
    """What travels: every aggregate one engine produced in one window, with its ordering key.

    ``(engine_id, seq)`` is unique; stores use it to ingest a redelivered batch once.
    """

    engine_id: str
    seq: int
    window_start: float
    window_end: float
    acceptance: tuple[AcceptanceWindow, ...] = ()
    cost: tuple[CostWindow, ...] = ()
    sampled_rounds: tuple[RoundRecord, ...] = ()  # optional raw rounds for offline replay
    dropped_before: int = 0  # windows the emitter had to drop before this one (reported, never silent)
    schema_version: int = SCHEMA_VERSION


# ------------------------------------------------------------------------------------------ policy table
POLICY_SCHEMA_VERSION = 1  # bump when the table's JSON changes shape; clients reject unknown versions


@dataclass(frozen=True)
class PolicyTable:
    """A versioned, JSON-safe mapping from bucket key to k, with a default for unknown buckets.

    Keys are :meth:`Bucket.key` strings; any of the five parts may be ``"*"``. A row's k is the entry of its
    exact bucket, else of progressively broader keys, else ``default_k``: the order and the one lookup live in
    :mod:`telemetry.policy_table`, with the table's JSON form, its size caps and its validation. A
    batch-size-only projection (vLLM ``num_speculative_tokens_per_batch_size``) is a table whose keys are all
    ``*`` except the batch bucket.
    """

    version: int  # increases with every table the sidecar publishes; clients never go back
    default_k: int  # k for buckets no entry covers
    k_max: int = MAX_DRAFT_LEN  # the largest k any entry may ask for
    entries: dict[str, int] = field(default_factory=dict)
    created_at: float = 0.0
    reason: str = ""  # why this version exists (what changed), for operators
    schema_version: int = POLICY_SCHEMA_VERSION
