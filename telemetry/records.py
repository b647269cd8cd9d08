"""The shared vocabulary of spectune: what the engine observes, what travels, and the policy table.

Imports nothing heavy (no torch, no Redis, no SQL): the engine, the sidecar, the store and the policies all read
these definitions, and the sidecar must run on a machine without torch.

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

import json
import math
import operator
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1  # bump when a travelling record changes shape; receivers reject unknown versions
MAX_DRAFT_LEN = 16  # verify cost grows with k + 1; no useful policy drafts further on any engine we know
MAX_ENCODED_BYTES = 1 << 20  # size cap of one encoded window batch; larger payloads are rejected unread
MAX_NAME_LEN = 64  # request types, version ids and engine ids are short labels
WILDCARD = "*"  # a bucket key part that matches anything (pins and table entries)
MIN_BATCH_BUCKET = 1  # a batch holds at least one row; batch buckets are upper edges, so >= 1 too
REQUEST_TYPES = ("code", "prose", "structured")  # the reference workloads; others are allowed on the wire
DEFAULT_BATCH_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # powers of two, as engines size CUDA graphs
DEFAULT_CONTEXT_EDGES = (512, 2048, 8192)  # <=512, <=2k, <=8k, >8k


class RecordError(ValueError):
    """A record failed validation. ``reason`` is a short, countable label (e.g. ``accepted_gt_drafted``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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


@dataclass(frozen=True)
class Bucket:
    """What a decision is made for: (versions, request type, batch-size bucket, context bucket)."""

    target_version: str
    draft_version: str
    request_type: str
    batch_bucket: int
    context_bucket: str

    def key(self) -> str:
        return "|".join(
            (self.target_version, self.draft_version, self.request_type, str(self.batch_bucket), self.context_bucket)
        )

    @classmethod
    def from_key(cls, key: str) -> Bucket:
        """The exact bucket a key names (no ``*`` parts); see :func:`parse_bucket_key` for the rules."""
        t, d, r, bb, c = parse_bucket_key(key, wildcard=False)
        assert bb is not None  # wildcard=False: the batch part is always a number
        return cls(t, d, r, bb, c)


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


# ------------------------------------------------------------------------------------------ validation
# Every check below runs on every record a sidecar ingests (about 50 aggregates per window batch), so the happy
# path builds no strings: each check is a plain comparison, and the reason and message are made only when it
# fails. The two hot decoders (acceptance and cost entries) first try a conservative inline guard over the
# fields they need (exact ``int`` / ``float`` / ``str`` types, the same bounds) and, only when the guard fails,
# run the helpers in the original order, which raise the same reason as always (or accept an ``int`` subclass,
# as before). Each check is still defined once, in the helpers and in the relation checks after the guards.
_INF = math.inf


def _name(v: Any, what: str) -> str:
    """The one rule for a label (request type, version id, engine id, context bucket, bucket key part): 1 to
    ``MAX_NAME_LEN`` printable characters without ``|`` (no NUL or other control characters, which PostgreSQL
    refuses in text and which no operator can read back)."""
    if type(v) is str and 0 < len(v) <= MAX_NAME_LEN and "|" not in v and v.isprintable():
        return v
    if not isinstance(v, str):
        raise RecordError("bad_type", f"{what} must be a string, got {type(v).__name__}")
    if not 0 < len(v) <= MAX_NAME_LEN:
        raise RecordError("bad_name", f"{what} must be 1..{MAX_NAME_LEN} chars")
    if "|" in v:
        raise RecordError("bad_name", f"{what} must not contain '|'")
    if not v.isprintable():
        raise RecordError("bad_name", f"{what}={v!r} must be printable (no control characters)")
    return str(v)


_ASCII_DIGITS = frozenset("0123456789")
BUCKET_KEY_PARTS = ("target_version", "draft_version", "request_type", "batch_bucket", "context_bucket")


def parse_bucket_key(key: Any, *, wildcard: bool = True) -> tuple[str, str, str, int | None, str]:
    """The one parser of bucket keys (``target|draft|request type|batch bucket|context bucket``).

    Every place that reads a key (tables on the wire, pins from operators, the Prometheus export) uses this, so
    each rule exists once:

    - five ``|``-separated parts, each a label under the wire rule of :func:`_name`, or ``*`` when ``wildcard``;
    - the batch part is an integer >= ``MIN_BATCH_BUCKET`` written in canonical ASCII digits (no sign, no leading
      zero, no spaces): ``str.isdigit`` accepts ``'²'`` and ``int`` accepts ``'٣'``, and a key that does not
      read back as ``str(int(part))`` would never match the keys the sidecar writes.

    Args:
        key: the key as received.
        wildcard: whether ``*`` parts are allowed (pins and table entries: yes; an exact bucket: no).

    Returns:
        The five parts, the batch bucket as an int (None for ``*``).

    Raises:
        RecordError: ``bad_bucket_key``, naming the part and the rule it broke.
    """
    if not isinstance(key, str):
        raise RecordError("bad_bucket_key", f"a bucket key must be a string, got {type(key).__name__}")
    parts = key.split("|")
    if len(parts) != len(BUCKET_KEY_PARTS):
        raise RecordError("bad_bucket_key", f"{key[:400]!r} must have 5 '|'-separated parts "
                                            "(target|draft|request type|batch bucket|context bucket)")
    for part, what in zip(parts, BUCKET_KEY_PARTS, strict=True):
        if part == WILDCARD:
            if not wildcard:
                raise RecordError("bad_bucket_key", f"{what} of {key!r} must be exact here, not '{WILDCARD}'")
            continue
        try:
            _name(part, what)
        except RecordError as e:
            raise RecordError("bad_bucket_key", f"in bucket key {key!r}: {e.detail}") from None
    raw = parts[3]
    batch: int | None = None
    if raw != WILDCARD:
        if not _ASCII_DIGITS.issuperset(raw) or raw[0] == "0" or int(raw) < MIN_BATCH_BUCKET:
            raise RecordError("bad_bucket_key", f"batch bucket {raw!r} of {key!r} must be an integer >= "
                                                f"{MIN_BATCH_BUCKET} in ASCII digits without a leading zero"
                                                + (f", or '{WILDCARD}'" if wildcard else ""))
        batch = int(raw)
    return parts[0], parts[1], parts[2], batch, parts[4]


def _int(v: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if type(v) is int and v >= lo and (hi is None or v <= hi):
        return v
    if not isinstance(v, int) or isinstance(v, bool):
        raise RecordError("bad_type", f"{what} must be an int")
    if v < lo or (hi is not None and v > hi):
        raise RecordError("out_of_range", f"{what}={v} outside [{lo}, {hi}]")
    return int(v)


def _time(v: Any, what: str) -> float:
    if type(v) is float and 0.0 < v < _INF:  # NaN fails both comparisons; 0.0 takes the checks below (-0.0)
        return v
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise RecordError("bad_type", f"{what} must be a number")
    try:
        finite = math.isfinite(v)
    except OverflowError:  # an int beyond any float (JSON allows 400 digits): finite, but not a time
        raise RecordError("out_of_range", f"{what} does not fit a float") from None
    if not finite:
        raise RecordError("non_finite", f"{what} is not finite")
    if v < 0 or math.copysign(1.0, v) < 0:  # -0.0 == 0 but is no clock reading: a forged or broken sender
        raise RecordError("negative_time", f"{what}={v} is negative")
    return float(v)


def _stat(d: Any, what: str) -> Stat:
    if not isinstance(d, dict):
        raise RecordError("bad_type", f"{what} must be an object")
    c, t, q, m = d.get("count"), d.get("total"), d.get("sumsq"), d.get("max")
    if not (
        type(c) is int and c >= 0
        and type(t) is float and 0.0 < t < _INF
        and type(q) is float and 0.0 < q < _INF
        and type(m) is float and 0.0 < m < _INF
    ):
        c = _int(c, f"{what}.count")
        t, q, m = _time(t, f"{what}.total"), _time(q, f"{what}.sumsq"), _time(m, f"{what}.max")
    return Stat(c, t, q, m)


def _nonneg_ints(raw: Any, what: str) -> tuple[int, ...]:
    """A list of ints >= 0 as a tuple (the guard is the loop; the helper names the first bad element)."""
    if type(raw) is not list and not isinstance(raw, list | tuple):
        raise RecordError("bad_type", f"{what} must be a list")
    for h in raw:
        if type(h) is not int or h < 0:
            return tuple(_int(x, f"{what}[i]") for x in raw)
    return tuple(raw)


def acceptance_from_dict(d: Any) -> AcceptanceWindow:
    if not isinstance(d, dict):
        raise RecordError("bad_type", "acceptance entry must be an object")
    g = d.get
    k, rows, drafted, accepted, emitted = g("k"), g("rows"), g("drafted"), g("accepted"), g("emitted")
    if not (
        type(k) is int and 0 <= k <= MAX_DRAFT_LEN
        and type(rows) is int and rows >= 0
        and type(drafted) is int and drafted >= 0
        and type(accepted) is int and accepted >= 0
        and type(emitted) is int and emitted >= 0
    ):
        k = _int(k, "k", 0, MAX_DRAFT_LEN)
        rows = _int(rows, "rows")
        drafted = _int(drafted, "drafted")
        accepted = _int(accepted, "accepted")
        emitted = _int(emitted, "emitted")
    hist = _nonneg_ints(g("hist"), "hist")
    if len(hist) != k + 1:
        raise RecordError("bad_hist", f"hist has {len(hist)} bins, expected k + 1 = {k + 1}")
    if drafted != rows * k:
        raise RecordError("bad_drafted", f"drafted={drafted} != rows * k = {rows * k}")
    if accepted > drafted:
        raise RecordError("accepted_gt_drafted", f"accepted={accepted} > drafted={drafted}")
    if sum(hist) != rows:
        raise RecordError("bad_hist", f"hist sums to {sum(hist)}, expected rows={rows}")
    if sum(map(operator.mul, range(len(hist)), hist)) != accepted:  # sum of i * hist[i]
        raise RecordError("bad_hist", "hist does not add up to accepted")
    if emitted > accepted + rows:
        raise RecordError("emitted_gt_possible", f"emitted={emitted} > accepted + rows")
    return AcceptanceWindow(
        _name(g("target_version"), "target_version"),
        _name(g("draft_version"), "draft_version"),
        _name(g("request_type"), "request_type"),
        _name(g("context_bucket"), "context_bucket"),
        k, rows, drafted, accepted, emitted, hist,
    )


def cost_from_dict(d: Any) -> CostWindow:
    if not isinstance(d, dict):
        raise RecordError("bad_type", "cost entry must be an object")
    g = d.get
    max_k, rounds, tv, batch_rows = g("max_k"), g("rounds"), g("tokens_verified"), g("batch_rows")
    if not (
        type(max_k) is int and 0 <= max_k <= MAX_DRAFT_LEN
        and type(rounds) is int and rounds >= 1
        and type(tv) is int and tv >= 0
        and type(batch_rows) is int and batch_rows >= rounds
    ):
        max_k = _int(max_k, "max_k", 0, MAX_DRAFT_LEN)
        rounds = _int(rounds, "rounds", 1)
        tv = _int(tv, "tokens_verified")
        batch_rows = _int(batch_rows, "batch_rows", rounds)
    if not batch_rows <= tv <= batch_rows * (max_k + 1):  # packed: each row verifies 1..max_k + 1 tokens
        raise RecordError("bad_tokens_verified", "tokens_verified outside [batch_rows, batch_rows * (max_k + 1)]")
    return CostWindow(
        target_version=_name(g("target_version"), "target_version"),
        draft_version=_name(g("draft_version"), "draft_version"),
        batch_bucket=_int(g("batch_bucket"), "batch_bucket", MIN_BATCH_BUCKET),
        context_bucket=_name(g("context_bucket"), "context_bucket"),
        max_k=max_k, rounds=rounds, tokens_verified=tv,
        emitted=_int(g("emitted"), "emitted"),
        batch_rows=batch_rows,
        draft_s=_stat(g("draft_s"), "draft_s"),
        verify_s=_stat(g("verify_s"), "verify_s"),
        other_s=_stat(g("other_s"), "other_s"),
        latency_p50=_time(g("latency_p50"), "latency_p50"),
        latency_p95=_time(g("latency_p95"), "latency_p95"),
        latency_p99=_time(g("latency_p99"), "latency_p99"),
    )


def round_from_dict(d: Any) -> RoundRecord:
    if not isinstance(d, dict):
        raise RecordError("bad_type", "round must be an object")
    rows_raw = d.get("rows")
    if not isinstance(rows_raw, list | tuple):
        raise RecordError("bad_type", "rows must be a list")
    max_k = _int(d.get("max_k"), "max_k", 0, MAX_DRAFT_LEN)
    rows = []
    for r in rows_raw:
        if not isinstance(r, dict):
            raise RecordError("bad_type", "row must be an object")
        k = _int(r.get("k"), "row.k", 0, max_k)
        acc = _int(r.get("accepted"), "row.accepted", 0)
        if acc > k:
            raise RecordError("accepted_gt_drafted", f"row accepted={acc} > k={k}")
        rows.append(RowRecord(
            request_type=_name(r.get("request_type"), "request_type"),
            context_len=_int(r.get("context_len"), "context_len"),
            k=k, accepted=acc, emitted=_int(r.get("emitted"), "emitted", 0, acc + 1),
        ))
    return RoundRecord(
        round_index=_int(d.get("round_index"), "round_index"),
        batch_size=_int(d.get("batch_size"), "batch_size", 1),
        max_k=max_k,
        tokens_verified=_int(d.get("tokens_verified"), "tokens_verified"),
        draft_s=_time(d.get("draft_s"), "draft_s"),
        verify_s=_time(d.get("verify_s"), "verify_s"),
        other_s=_time(d.get("other_s"), "other_s"),
        target_version=_name(d.get("target_version"), "target_version"),
        draft_version=_name(d.get("draft_version"), "draft_version"),
        rows=tuple(rows),
        timestamp=_time(d.get("timestamp", 0.0), "timestamp"),
        prefill_s=_time(d.get("prefill_s", 0.0), "prefill_s"),  # absent from engines that predate it
    )


def window_batch_to_dict(b: WindowBatch) -> dict[str, Any]:
    """The batch as plain dicts, equal to ``dataclasses.asdict(b)``, built directly: ``asdict`` deep-copies
    every field and would be the emitter's largest cost per window."""
    d = dict(b.__dict__)
    d["acceptance"] = tuple(dict(a.__dict__) for a in b.acceptance)
    d["cost"] = tuple(_cost_to_dict(c) for c in b.cost)
    d["sampled_rounds"] = tuple(_round_to_dict(r) for r in b.sampled_rounds)
    return d


def _cost_to_dict(c: CostWindow) -> dict[str, Any]:
    d = dict(c.__dict__)
    for name in ("draft_s", "verify_s", "other_s"):
        d[name] = dict(getattr(c, name).__dict__)
    return d


def _round_to_dict(r: RoundRecord) -> dict[str, Any]:
    d = dict(r.__dict__)
    d["rows"] = tuple(dict(x.__dict__) for x in r.rows)
    return d


def window_batch_from_dict(d: Any) -> WindowBatch:
    """Validate a decoded window batch. Raises :class:`RecordError` with a countable ``reason``."""
    if not isinstance(d, dict):
        raise RecordError("bad_type", "window batch must be an object")
    sv = d.get("schema_version")
    if type(sv) is not int or sv != SCHEMA_VERSION:  # True == 1 and 1.0 == 1 in Python; neither is a version
        raise RecordError("unknown_schema_version", f"schema_version={sv!r}, this build reads {SCHEMA_VERSION}")
    acc = d.get("acceptance", [])
    cost = d.get("cost", [])
    sampled = d.get("sampled_rounds", [])
    for v, what in ((acc, "acceptance"), (cost, "cost"), (sampled, "sampled_rounds")):
        if not isinstance(v, list | tuple):
            raise RecordError("bad_type", f"{what} must be a list")
    start = _time(d.get("window_start"), "window_start")
    end = _time(d.get("window_end"), "window_end")
    if end < start:
        raise RecordError("bad_window", "window_end < window_start")
    return WindowBatch(
        engine_id=_name(d.get("engine_id"), "engine_id"),
        seq=_int(d.get("seq"), "seq"),
        window_start=start,
        window_end=end,
        acceptance=tuple(acceptance_from_dict(a) for a in acc),
        cost=tuple(cost_from_dict(c) for c in cost),
        sampled_rounds=tuple(round_from_dict(r) for r in sampled),
        dropped_before=_int(d.get("dropped_before", 0), "dropped_before"),
        schema_version=SCHEMA_VERSION,
    )


def check_size(data: bytes | bytearray | memoryview) -> None:
    """The one size cap on an encoded window batch, whatever its encoding (raises ``too_large``)."""
    if len(data) > MAX_ENCODED_BYTES:
        raise RecordError("too_large", f"{len(data)} bytes > cap {MAX_ENCODED_BYTES}")


def encode_window_batch(b: WindowBatch) -> bytes:
    """JSON bytes (never pickle). msgpack is offered by the transport layer with the same dict shape."""
    data = json.dumps(window_batch_to_dict(b), separators=(",", ":"), allow_nan=False).encode()
    check_size(data)
    return data


def decode_window_batch(data: bytes) -> WindowBatch:
    """Decode and validate. Any byte string either yields a valid batch or raises :class:`RecordError`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RecordError("bad_type", f"payload must be bytes, got {type(data).__name__}")
    check_size(data)
    try:
        obj = json.loads(bytes(data), parse_constant=_reject_constant)
    except RecordError:  # NaN / Infinity, from _reject_constant (a RecordError is a ValueError too)
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, an int over 4300 digits
        raise RecordError("undecodable", f"not JSON: {e}") from e
    return window_batch_from_dict(obj)


def _reject_constant(name: str) -> Any:
    raise RecordError("non_finite", f"{name} is not allowed")


# ------------------------------------------------------------------------------------------ policy table
POLICY_SCHEMA_VERSION = 1
# Size caps of a policy table, checked by the sidecar before it stores and publishes one and by every client
# before it parses one. The sidecar's own tables stay far below (SidecarConfig.max_table_buckets, 4096 by
# default, plus a few pins); a table past them is a forgery or a runaway pin script. A client holds a table as a
# dict plus a lookup cache, about 7x its JSON (a 28.9 MB table cost a client about 190 MB), so 4 MiB bounds what
# any table can cost an engine to some 30 MB.
MAX_TABLE_ENTRIES = 16_384
MAX_TABLE_BYTES = 4 << 20
# Versions are stored as a 64-bit integer (policy_versions.version is BIGINT); larger ones cannot be stored.
MAX_POLICY_VERSION = (1 << 63) - 1


@dataclass(frozen=True)
class PolicyTable:
    """A versioned, JSON-safe mapping from bucket key to k, with a default for unknown buckets.

    Keys are :meth:`Bucket.key` strings; any of the five parts may be ``"*"``. Lookup tries the exact bucket,
    then progressively broader keys (see :func:`fallback_keys`), then ``default_k``. A batch-size-only
    projection (vLLM ``num_speculative_tokens_per_batch_size``) is a table whose keys are all ``*`` except the
    batch bucket.
    """

    version: int
    default_k: int
    k_max: int = MAX_DRAFT_LEN
    entries: dict[str, int] = field(default_factory=dict)
    created_at: float = 0.0
    reason: str = ""  # why this version exists (what changed), for operators
    schema_version: int = POLICY_SCHEMA_VERSION

    def lookup(self, bucket: Bucket) -> int:
        for key in fallback_keys(bucket):
            k = self.entries.get(key)
            if k is not None:
                return k
        return self.default_k

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def fallback_keys(b: Bucket) -> list[str]:
    """Exact key first, then broader: any context, any request type, any batch size, any versions."""
    w = WILDCARD
    t, d, r, bb, c = b.target_version, b.draft_version, b.request_type, str(b.batch_bucket), b.context_bucket
    return [
        "|".join(p)
        for p in (
            (t, d, r, bb, c), (t, d, r, bb, w), (t, d, w, bb, c), (t, d, w, bb, w),
            (t, d, r, w, w), (t, d, w, w, w), (w, w, r, bb, c), (w, w, w, bb, w), (w, w, w, w, w),
        )
    ]


def check_table_size(table: PolicyTable) -> None:
    """The sidecar's side of the table size cap: refuse to store or publish a table a client would refuse.

    Raises:
        RecordError: ``table_too_large`` with the entry count or encoded size and the cap.
    """
    if len(table.entries) > MAX_TABLE_ENTRIES:
        raise RecordError("table_too_large", f"table v{table.version} has {len(table.entries)} entries > cap "
                                             f"{MAX_TABLE_ENTRIES}; remove pins or lower max_table_buckets")
    n = len(table.to_json().encode())
    if n > MAX_TABLE_BYTES:
        raise RecordError("table_too_large", f"table v{table.version} encodes to {n} bytes > cap {MAX_TABLE_BYTES}; "
                                             "remove pins or lower max_table_buckets")


def policy_table_from_json(text: str | bytes) -> PolicyTable:
    """Parse and validate a policy table. Raises :class:`RecordError` with a countable ``reason``.

    The size caps are checked first: bytes before anything is parsed, entries before any is validated.
    """
    if not isinstance(text, str | bytes | bytearray):
        raise RecordError("bad_type", f"policy table must be str or bytes, got {type(text).__name__}")
    if len(text) > MAX_TABLE_BYTES:  # chars <= bytes: a str over the cap is over it encoded too
        raise RecordError("table_too_large", f"policy table of {len(text)} bytes > cap {MAX_TABLE_BYTES}")
    try:
        d = json.loads(text, parse_constant=_reject_constant)
    except RecordError:  # NaN / Infinity, from _reject_constant (a RecordError is a ValueError too)
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, an int over 4300 digits
        raise RecordError("undecodable", f"policy table is not JSON: {e}") from e
    if not isinstance(d, dict):
        raise RecordError("bad_type", "policy table must be an object")
    sv = d.get("schema_version")
    if type(sv) is not int or sv != POLICY_SCHEMA_VERSION:  # True and 1.0 equal 1 but are not a version
        raise RecordError("unknown_schema_version",
                          f"policy schema_version={sv!r}, expected {POLICY_SCHEMA_VERSION}")
    k_max = _int(d.get("k_max"), "k_max", 0, MAX_DRAFT_LEN)
    entries_raw = d.get("entries")
    if not isinstance(entries_raw, dict):
        raise RecordError("bad_type", "entries must be an object")
    if len(entries_raw) > MAX_TABLE_ENTRIES:
        raise RecordError("table_too_large", f"policy table has {len(entries_raw)} entries > cap {MAX_TABLE_ENTRIES}")
    entries = {}
    for key, k in entries_raw.items():
        parse_bucket_key(key)
        entries[key] = k if type(k) is int and 0 <= k <= k_max else _int(k, f"entries[{key!r}]", 0, k_max)
    reason = d.get("reason", "")
    if not isinstance(reason, str):
        raise RecordError("bad_type", "reason must be a string")
    return PolicyTable(
        version=_int(d.get("version"), "version", 0, MAX_POLICY_VERSION),
        default_k=_int(d.get("default_k"), "default_k", 0, k_max),
        k_max=k_max,
        entries=entries,
        created_at=_time(d.get("created_at", 0.0), "created_at"),
        reason=reason[:500],
    )
