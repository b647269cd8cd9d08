"""What travels, and the one rule for each field of it: encoding, decoding and validation of window batches.

Each travelling record is defined once, as its dataclass in :mod:`telemetry.records`; its wire definition here
is a ``msgspec.Struct`` derived from that dataclass (same fields, order and defaults) whose field types carry the
per-field rules (``Meta`` bounds, checked in C while decoding). One builder function per record carries the rules
between fields and builds the record, and the same definitions serve JSON and msgpack, the sidecar's decoder, the
engine's own check of the rounds it aggregates (:func:`check_round`, :func:`check_rounds`) and the policies' check
of the windows they learn from (:func:`check_window`). Bucket keys and labels are parsed here too
(:func:`parse_bucket_key`, :func:`check_label`), so that every rule exists once.

Every failure is a :class:`~telemetry.records.RecordError` whose ``reason`` is a short countable label
(``bad_type``, ``out_of_range``, ``bad_name``, ``non_finite``, ``negative_time``, ``bad_hist``,
``implausible``, ...): the sidecar counts rejected entries by it and dead-letters them with it.

JSON stays the readable default (``redis-cli`` shows it); msgpack is the same shape, smaller and faster. A payload
is told apart by its first byte (a JSON object starts with ``{``, a msgpack map never does). Never pickle.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from operator import mul as _mul
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypeAlias, get_type_hints

import msgspec
from msgspec import Meta, Struct

from telemetry.records import (
    MAX_DRAFT_LEN,
    MAX_ENCODED_BYTES,
    MAX_NAME_LEN,
    MIN_BATCH_BUCKET,
    SCHEMA_VERSION,
    WILDCARD,
    AcceptanceWindow,
    Bucket,
    CostWindow,
    RecordError,
    RoundRecord,
    RowRecord,
    Stat,
    WindowBatch,
)

Encoding = Literal["json", "msgpack"]
ENCODINGS: tuple[Encoding, ...] = ("json", "msgpack")

# ------------------------------------------------------------------------------------------ field rules
MAX_INT64 = (1 << 63) - 1  # counts and sequence numbers are stored as 64-bit integers (BIGINT)
# A sequence number or other counter: anything a BIGINT holds.
Count = Annotated[int, Meta(ge=0, le=MAX_INT64)]
# What one window or round measured (rows, tokens, rounds): ~10^12 at most, far past any engine's window (512
# rows x 2,000 rounds a second). Larger is a forged entry, and its sums would overflow the float state learnt
# from it (a policy's aggregates, the alert detectors).
MAX_TALLY = 1 << 40
Tally = Annotated[int, Meta(ge=0, le=MAX_TALLY)]
# Mean seconds per round above this is a stopped clock or a forged entry, not a measurement.
MAX_ROUND_SECONDS = 3600.0
# A draft length: 0 (speculation off) to MAX_DRAFT_LEN.
DraftLen = Annotated[int, Meta(ge=0, le=MAX_DRAFT_LEN)]
# A batch bucket is an upper edge of batch sizes, so at least one row.
BatchBucket = Annotated[int, Meta(ge=MIN_BATCH_BUCKET)]
# Seconds (durations and wall-clock readings): finite and >= 0. NaN fails the lower bound, inf the upper one;
# -0.0 passes both and is refused by refuse_negative_zero, the rest of this one rule.
Seconds = Annotated[float, Meta(ge=0.0, le=sys.float_info.max)]

_MAX_KNOWN_LABELS = 4096  # labels repeat (versions, request types, context buckets): remember the good ones
_known_labels: set[str] = set()


class RuleBroken(Exception):
    """A broken rule's reason, raised by the checks here and turned into a :class:`RecordError` (with the
    schema-version rule first) where a decode or check leaves this module."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


def rule_broken(reason: str, detail: str) -> NoReturn:
    raise RuleBroken(reason, detail)


def check_label(v: Any, what: str) -> str:
    """The one rule for a label (request type, version id, engine id, context bucket, bucket-key part).

    1 to ``MAX_NAME_LEN`` printable characters without ``|`` (the bucket-key separator). Control characters
    (NUL and the like) are refused: PostgreSQL refuses NUL in text and no operator can read them back.

    Raises:
        RecordError: ``bad_type`` for a non-string, ``bad_name`` for a string that breaks the rule.
    """
    try:
        return _label(v, what)
    except RuleBroken as e:
        raise RecordError(e.reason, e.detail) from None


def _label(v: Any, what: str) -> str:
    if type(v) is str and v in _known_labels:
        return v
    if not isinstance(v, str):
        rule_broken("bad_type", f"{what} must be a string, got {type(v).__name__}")
    if not 0 < len(v) <= MAX_NAME_LEN:
        rule_broken("bad_name", f"{what} must be 1..{MAX_NAME_LEN} chars")
    if "|" in v:
        rule_broken("bad_name", f"{what} must not contain '|'")
    if not v.isprintable():
        rule_broken("bad_name", f"{what}={v!r} must be printable (no control characters)")
    if len(_known_labels) >= _MAX_KNOWN_LABELS:  # hostile senders may invent labels without end
        _known_labels.clear()
    _known_labels.add(v)
    return v


def check_draft_len(v: Any, what: str) -> int:
    """The draft-length rule (:data:`DraftLen`) for a k that does not travel inside a record (a pin's).

    Raises:
        RecordError: ``bad_type`` for a non-int (a bool included), ``out_of_range`` outside [0, MAX_DRAFT_LEN].
    """
    try:
        k: int = msgspec.convert(v, DraftLen)
    except msgspec.ValidationError as e:
        err = record_error(e, v)
        raise RecordError(err.reason, f"{what}={v!r}: {err.detail}") from None
    return k


def refuse_negative_zero(what: str, *values: float) -> None:
    # -0.0 == 0.0 passes every bound, but no clock or timer reads it: the sender is forged or broken.
    for v in values:
        if v == 0.0 and math.copysign(1.0, v) < 0:
            rule_broken("negative_time", f"{what}=-0.0 is negative")


# ------------------------------------------------------------------------------------------ bucket keys
_ASCII_DIGITS = frozenset("0123456789")
BUCKET_KEY_PARTS = ("target_version", "draft_version", "request_type", "batch_bucket", "context_bucket")


def parse_bucket_key(key: Any, *, wildcard: bool = True) -> tuple[str, str, str, int | None, str]:
    """The one parser of bucket keys (``target|draft|request type|batch bucket|context bucket``).

    - five ``|``-separated parts, each a label under :func:`check_label`, or ``*`` when ``wildcard``;
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
            _label(part, what)
        except RuleBroken as e:
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


def parse_bucket(key: Any) -> Bucket:
    """The exact bucket a key names (no ``*`` parts), under the rules of :func:`parse_bucket_key`."""
    t, d, r, bb, c = parse_bucket_key(key, wildcard=False)
    assert bb is not None  # wildcard=False: the batch part is always a number
    return Bucket(t, d, r, bb, c)


# ------------------------------------------------------------------------------------- wire definitions
# A record's wire definition is a Struct derived from its dataclass (_wire_struct): the record's fields, in its
# order, with its defaults, each typed by its rule (checked in C while decoding). The function after each checks
# the rules between fields and the labels, and builds the record. Decoding, msgspec.convert of plain objects and
# the checks of records in memory all go through both, so a rule cannot be skipped on one path.
#
# The records are frozen dataclasses, whose __init__ pays one object.__setattr__ per field: more than decoding
# and checking together. The builders give a new instance its field dict directly, as pickle and copy do; the
# records have no __post_init__ for this to skip (_wire_struct asserts it).
_new = object.__new__
_set = object.__setattr__


def _build(cls: type[Any], fields: dict[str, Any]) -> Any:
    obj = _new(cls)
    _set(obj, "__dict__", fields)
    return obj


def _wire_struct(
    name: str,
    record: type[Any],
    rules: dict[str, Any],
    *,
    required: tuple[str, ...] = (),
    wire_defaults: dict[str, Any] | None = None,
) -> type[Struct]:
    """The wire definition of ``record``: a frozen Struct with the record's fields, in its order, with its defaults.

    Args:
        name: the Struct's class name (its repr, and the type hypothesis draws in ``bench/faults.py``).
        record: a frozen dataclass of :mod:`telemetry.records`.
        rules: field name -> the type the field is decoded as: a ``Meta``-bounded type, or the wire definition
            of a nested record. A field without a rule must be a label (``str``), which the builder checks.
        required: fields a sender must send though the record has a default for them.
        wire_defaults: field name -> the default the wire has instead of the record's.
    """
    assert not hasattr(record, "__post_init__"), f"{record.__name__} gained a __post_init__: build it normally"
    hints = get_type_hints(record)
    fields = dataclasses.fields(record)
    unknown = (set(rules) | set(required) | set(wire_defaults or ())) - {f.name for f in fields}
    assert not unknown, f"wire settings for fields {record.__name__} does not have: {sorted(unknown)}"
    spec: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in fields:
        assert f.name in rules or hints[f.name] is str, f"{record.__name__}.{f.name} needs a rule on the wire"
        assert f.default_factory is dataclasses.MISSING, f"{record.__name__}.{f.name}: a default factory"
        rule = rules.get(f.name, str)
        default = dataclasses.MISSING if f.name in required else (wire_defaults or {}).get(f.name, f.default)
        spec.append((f.name, rule) if default is dataclasses.MISSING else (f.name, rule, default))
    return msgspec.defstruct(name, spec, module=__name__, frozen=True, gc=False)


if TYPE_CHECKING:  # to a type checker, a wire definition reads as its record: it has the same fields
    _Stat: TypeAlias = Stat
    _Acceptance: TypeAlias = AcceptanceWindow
    _Cost: TypeAlias = CostWindow
    _Row: TypeAlias = RowRecord
    _Round: TypeAlias = RoundRecord
    _Batch: TypeAlias = WindowBatch
else:
    # A stat travels whole: its four numbers or nothing (the record's zeros are for building one up).
    _Stat = _wire_struct("_Stat", Stat, {"count": Tally, "total": Seconds, "sumsq": Seconds, "max": Seconds},
                         required=("count", "total", "sumsq", "max"))
    _Acceptance = _wire_struct("_Acceptance", AcceptanceWindow, {
        "k": DraftLen, "rows": Tally, "drafted": Tally, "accepted": Tally, "emitted": Tally,
        "hist": tuple[Tally, ...],
    })
    _Cost = _wire_struct("_Cost", CostWindow, {
        "batch_bucket": BatchBucket, "max_k": DraftLen,
        "rounds": Annotated[int, Meta(ge=1, le=MAX_TALLY)],  # a cost window without rounds is no window
        "tokens_verified": Tally, "emitted": Tally, "batch_rows": Tally,
        "draft_s": _Stat, "verify_s": _Stat, "other_s": _Stat,
        "latency_p50": Seconds, "latency_p95": Seconds, "latency_p99": Seconds,
    })
    _Row = _wire_struct("_Row", RowRecord, {"context_len": Tally, "k": DraftLen, "accepted": Tally, "emitted": Tally})
    _Round = _wire_struct("_Round", RoundRecord, {
        "round_index": Count, "batch_size": Annotated[int, Meta(ge=1)], "max_k": DraftLen, "tokens_verified": Tally,
        "draft_s": Seconds, "verify_s": Seconds, "other_s": Seconds, "rows": tuple[_Row, ...],
        "timestamp": Seconds,
        "prefill_s": Seconds,  # absent from engines that predate it: the record's default, 0.0
        "costed": bool,  # likewise: True
    })
    _Batch = _wire_struct("_Batch", WindowBatch, {
        "seq": Count, "window_start": Seconds, "window_end": Seconds,
        "acceptance": tuple[_Acceptance, ...], "cost": tuple[_Cost, ...], "sampled_rounds": tuple[_Round, ...],
        "dropped_before": Count,
        "schema_version": int | None,  # required: None (absent) is refused by name in _batch
    }, wire_defaults={"schema_version": None})


def _stat(s: _Stat) -> Stat:
    total, sumsq, mx = s.total, s.sumsq, s.max
    if not (total and sumsq and mx):
        refuse_negative_zero("a stat", total, sumsq, mx)
    return _build(Stat, {"count": s.count, "total": total, "sumsq": sumsq, "max": mx})


_BINS = tuple(range(k + 1) for k in range(MAX_DRAFT_LEN + 1))  # hist bin indices per k
_fields_of: Callable[[Any], dict[str, Any]] = msgspec.structs.asdict  # a wire struct's fields, in order


def _acceptance(a: _Acceptance) -> AcceptanceWindow:
    k, rows, drafted, accepted, emitted, hist = a.k, a.rows, a.drafted, a.accepted, a.emitted, a.hist
    if len(hist) != k + 1:
        rule_broken("bad_hist", f"hist has {len(hist)} bins, expected k + 1 = {k + 1}")
    if drafted != rows * k:
        rule_broken("bad_drafted", f"drafted={drafted} != rows * k = {rows * k}")
    if accepted > drafted:
        rule_broken("accepted_gt_drafted", f"accepted={accepted} > drafted={drafted}")
    if sum(hist) != rows:
        rule_broken("bad_hist", f"hist sums to {sum(hist)}, expected rows={rows}")
    if sum(map(_mul, _BINS[k], hist)) != accepted:  # sum of i * hist[i]
        rule_broken("bad_hist", "hist does not add up to accepted")
    if emitted > accepted + rows:  # each row emits its accepted drafts plus at most one more
        rule_broken("emitted_gt_possible", f"emitted={emitted} > accepted + rows")
    tv, dv, rt, cb = a.target_version, a.draft_version, a.request_type, a.context_bucket
    known = _known_labels
    if not (tv in known and dv in known and rt in known and cb in known):
        _label(tv, "target_version")
        _label(dv, "draft_version")
        _label(rt, "request_type")
        _label(cb, "context_bucket")
    w = _new(AcceptanceWindow)  # _build inline (tens of windows per batch): the struct has the record's fields
    _set(w, "__dict__", _fields_of(a))
    return w


def _cost(c: _Cost) -> CostWindow:
    rounds, batch_rows, tv = c.rounds, c.batch_rows, c.tokens_verified
    if batch_rows < rounds:  # every round has at least one row
        rule_broken("out_of_range", f"batch_rows={batch_rows} < rounds={rounds}")
    if not batch_rows <= tv <= batch_rows * (c.max_k + 1):  # packed: each row verifies 1..max_k + 1 tokens
        rule_broken("bad_tokens_verified", "tokens_verified outside [batch_rows, batch_rows * (max_k + 1)]")
    if not (c.latency_p50 and c.latency_p95 and c.latency_p99):
        refuse_negative_zero("a latency", c.latency_p50, c.latency_p95, c.latency_p99)
    if not c.draft_s.total + c.verify_s.total + c.other_s.total <= MAX_ROUND_SECONDS * rounds:
        rule_broken("implausible", f"more than {MAX_ROUND_SECONDS:.0f} s per round over {rounds} rounds")
    _label(c.target_version, "target_version")
    _label(c.draft_version, "draft_version")
    _label(c.context_bucket, "context_bucket")
    return _build(CostWindow, {
        "target_version": c.target_version, "draft_version": c.draft_version, "batch_bucket": c.batch_bucket,
        "context_bucket": c.context_bucket, "max_k": c.max_k, "rounds": rounds, "tokens_verified": tv,
        "emitted": c.emitted, "batch_rows": batch_rows, "draft_s": _stat(c.draft_s), "verify_s": _stat(c.verify_s),
        "other_s": _stat(c.other_s), "latency_p50": c.latency_p50, "latency_p95": c.latency_p95,
        "latency_p99": c.latency_p99,
    })


def _round_rules(r: _Round) -> None:
    max_k, bs = r.max_k, r.batch_size
    if not bs <= r.tokens_verified <= bs * (max_k + 1):  # packed: 1..max_k + 1 tokens per row
        rule_broken("bad_tokens_verified", f"tokens_verified={r.tokens_verified} outside [batch_size, "
                                           f"batch_size * (max_k + 1)] = [{bs}, {bs * (max_k + 1)}]")
    known = _known_labels
    for x in r.rows:
        if x.k > max_k:
            rule_broken("out_of_range", f"row k={x.k} outside [0, max_k={max_k}]")
        if x.accepted > x.k:
            rule_broken("accepted_gt_drafted", f"row accepted={x.accepted} > k={x.k}")
        if x.emitted > x.accepted + 1:
            rule_broken("out_of_range", f"row emitted={x.emitted} with accepted={x.accepted}")
        if x.request_type not in known:
            _label(x.request_type, "request_type")
    if not r.draft_s + r.verify_s + r.other_s <= MAX_ROUND_SECONDS:
        rule_broken("implausible", f"a round of more than {MAX_ROUND_SECONDS:.0f} s")
    if not (r.draft_s and r.verify_s and r.other_s and r.timestamp and r.prefill_s):
        refuse_negative_zero("a round time", r.draft_s, r.verify_s, r.other_s, r.timestamp, r.prefill_s)
    _label(r.target_version, "target_version")
    _label(r.draft_version, "draft_version")


def _round(r: _Round) -> RoundRecord:
    _round_rules(r)
    rows = tuple(_build(RowRecord, {"request_type": x.request_type, "context_len": x.context_len, "k": x.k,
                                    "accepted": x.accepted, "emitted": x.emitted}) for x in r.rows)
    return _build(RoundRecord, {
        "round_index": r.round_index, "batch_size": r.batch_size, "max_k": r.max_k,
        "tokens_verified": r.tokens_verified, "draft_s": r.draft_s, "verify_s": r.verify_s, "other_s": r.other_s,
        "target_version": r.target_version, "draft_version": r.draft_version, "rows": rows,
        "timestamp": r.timestamp, "prefill_s": r.prefill_s, "costed": r.costed,
    })


def _batch(b: _Batch) -> WindowBatch:
    _check_schema_version(b.schema_version)
    if b.window_end < b.window_start:
        rule_broken("bad_window", "window_end < window_start")
    refuse_negative_zero("window_start/window_end", b.window_start, b.window_end)
    _label(b.engine_id, "engine_id")
    return WindowBatch(b.engine_id, b.seq, b.window_start, b.window_end, tuple(map(_acceptance, b.acceptance)),
                       tuple(map(_cost, b.cost)), tuple(map(_round, b.sampled_rounds)), b.dropped_before)


def _check_schema_version(sv: object) -> None:
    if type(sv) is not int or sv != SCHEMA_VERSION:  # True == 1 and 1.0 == 1 in Python; neither is a version
        rule_broken("unknown_schema_version", f"schema_version={sv!r}, this build reads {SCHEMA_VERSION}")


# --------------------------------------------------------------------------------------------- errors
def _value_at(obj: Any, path: str) -> Any:
    """The value a msgspec error path (``$.cost[0].draft_s.total``) points at in ``obj`` (dicts, lists or
    records), or None when it cannot be followed."""
    for name, index in re.findall(r"\.(\w+)|\[(\d+)\]", path):
        try:
            step = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
            obj = step if name else obj[int(index)]
        except (IndexError, KeyError, TypeError):
            return None
    return obj


def record_error(e: Exception, raw: Any, schema_check: Callable[[object], None] | None = None) -> RecordError:
    """The project's error for a failed decode or check.

    Args:
        e: what msgspec raised (a ``ValidationError``) or a :class:`RuleBroken` from a builder.
        raw: the input as plain Python objects (None when it could not be read), to read the offending value.
        schema_check: the document's schema-version rule; a document of another version fails on that,
            whatever else it breaks.
    """
    if schema_check is not None and isinstance(raw, dict):
        try:
            schema_check(raw.get("schema_version"))
        except RuleBroken as r:
            return RecordError(r.reason, r.detail)
    if isinstance(e, RuleBroken):
        return RecordError(e.reason, e.detail)
    text = str(e)
    msg, _, at = text.partition(" - at `")
    path = at.rstrip("`")
    if path.endswith(".schema_version") or "`schema_version`" in msg:
        return RecordError("unknown_schema_version", f"schema_version: {text}")
    if msg.startswith("Expected `float` >="):  # NaN fails every comparison too: the value tells them apart
        value = _value_at(raw, path)
        reason = "non_finite" if isinstance(value, float) and not math.isfinite(value) else "negative_time"
    elif msg.startswith("Expected `float` <="):
        reason = "non_finite"
    elif msg.startswith(("Expected `int` >=", "Expected `int` <=")) or "out of range" in msg:
        reason = "out_of_range"
    elif msg.startswith(("Expected `", "Object missing required field")):
        reason = "bad_type"
    else:
        reason = "invalid"
    return RecordError(reason, text)


# ------------------------------------------------------------------------------------------- the codec
_JSON_ENCODER = msgspec.json.Encoder()
_MSGPACK_ENCODER = msgspec.msgpack.Encoder()
_JSON_BATCH = msgspec.json.Decoder(_Batch)
_MSGPACK_BATCH = msgspec.msgpack.Decoder(_Batch)
_ROUNDS = list[_Round]


def check_size(data: bytes | bytearray | memoryview) -> None:
    """The one size cap on an encoded window batch, whatever its encoding (raises ``too_large``)."""
    if len(data) > MAX_ENCODED_BYTES:
        raise RecordError("too_large", f"{len(data)} bytes > cap {MAX_ENCODED_BYTES}")


def encode_batch(batch: WindowBatch, encoding: Encoding = "json") -> bytes:
    """Encode a batch for the wire.

    Args:
        batch: the batch.
        encoding: ``"json"`` (default, readable in ``redis-cli``) or ``"msgpack"`` (smaller, faster).

    Raises:
        RecordError: ``unencodable`` (an int beyond 64 bits in msgpack, a value of no wire type) or
            ``too_large`` when the encoding exceeds ``MAX_ENCODED_BYTES``.
    """
    enc = _JSON_ENCODER if encoding == "json" else _MSGPACK_ENCODER
    try:
        data = enc.encode(batch)
    except (OverflowError, TypeError, ValueError) as e:
        raise RecordError("unencodable", f"{encoding} cannot encode the batch: {e}") from e
    check_size(data)
    return data


def decode_batch(data: bytes | bytearray | memoryview) -> WindowBatch:
    """Decode and validate a JSON or msgpack payload. Any byte string yields a batch or raises RecordError."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RecordError("bad_type", f"payload must be bytes, got {type(data).__name__}")
    check_size(data)
    is_json = bytes(data[:1]) == b"{" or bytes(data).lstrip()[:1] == b"{"
    try:
        return _batch((_JSON_BATCH if is_json else _MSGPACK_BATCH).decode(data))
    except (msgspec.ValidationError, RuleBroken) as e:
        raise record_error(e, as_plain(data, is_json), _check_schema_version) from None
    except (msgspec.DecodeError, RecursionError, ValueError) as e:  # not JSON / msgpack at all, or nested too deep
        raise undecodable(e, data, is_json) from None


def undecodable(e: Exception, data: str | bytes | bytearray | memoryview, is_json: bool = True) -> RecordError:
    """The error for a payload that does not parse (error path only). JSON's ``NaN`` / ``Infinity`` literals,
    which Python's ``json`` writes by default, are named for what they carry: a time that is not finite."""
    if is_json:
        try:
            json.loads(data if isinstance(data, str) else bytes(data), parse_constant=_non_finite_literal)
        except RuleBroken as r:
            return RecordError(r.reason, r.detail)
        except (ValueError, RecursionError):
            pass
    return RecordError("undecodable", f"not {'JSON' if is_json else 'JSON or msgpack'}: {e}")


def _non_finite_literal(name: str) -> NoReturn:
    rule_broken("non_finite", f"{name} is not a finite number")


def as_plain(data: str | bytes | bytearray | memoryview, is_json: bool = True) -> Any:
    """The payload as plain Python objects (error path only), to name what a typed decode refused.

    Raises:
        RecordError: ``undecodable`` (or ``non_finite``, see :func:`undecodable`) when it is not JSON or msgpack
            at all (trailing bytes after a msgpack value included): that comes before any field's rule.
    """
    try:
        return msgspec.json.decode(data) if is_json or isinstance(data, str) else msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError, ValueError) as e:
        raise undecodable(e, data, is_json) from None


def window_batch_to_dict(batch: WindowBatch) -> dict[str, Any]:
    """The batch as plain dicts and lists, the shape both encodings carry."""
    out: dict[str, Any] = msgspec.to_builtins(batch)
    return out


def window_batch_from_dict(d: Any) -> WindowBatch:
    """Validate a batch given as plain Python objects (the decoded shape), under the same rules as the wire."""
    try:
        return _batch(msgspec.convert(d, _Batch))
    except (msgspec.ValidationError, RuleBroken) as e:
        raise record_error(e, d, _check_schema_version) from None


def _check(obj: Any, wire_type: Any, build: Callable[[Any], object]) -> None:
    try:
        build(msgspec.convert(obj, wire_type, from_attributes=True))
    except (msgspec.ValidationError, RuleBroken) as e:
        raise record_error(e, obj) from None


# ------------------------------------------------------------------------------- records in memory
def check_round(r: RoundRecord) -> None:
    """Validate a round the engine handed over, under the wire's rules for a sampled round.

    Raises:
        RecordError: with a countable ``reason``.
    """
    _check(r, _Round, _round_rules)  # the rules alone: the engine holds the record already


def check_rounds(rounds: Sequence[RoundRecord]) -> list[RecordError | None]:
    """:func:`check_round` for a window's rounds at once (the emitter's aggregation): one conversion for all of
    them, and when that refuses one, each round alone, so every round gets its own verdict.

    Returns:
        Per round, None when it is valid, else the :class:`~telemetry.records.RecordError` it breaks.
    """
    try:
        wired = msgspec.convert(rounds, _ROUNDS, from_attributes=True)
    except msgspec.ValidationError:
        return list(map(_round_error, rounds))
    out: list[RecordError | None] = []
    for w in wired:
        try:
            _round_rules(w)
        except RuleBroken as e:
            out.append(RecordError(e.reason, e.detail))
        else:
            out.append(None)
    return out


def _round_error(r: RoundRecord) -> RecordError | None:
    try:
        check_round(r)
    except RecordError as e:
        return e
    return None


def check_window(w: AcceptanceWindow | CostWindow) -> None:
    """Validate an acceptance or cost window in memory, under the wire's rules.

    Raises:
        RecordError: with a countable ``reason``; ``bad_type`` for anything else.
    """
    if isinstance(w, AcceptanceWindow):
        _check(w, _Acceptance, _acceptance)
    elif isinstance(w, CostWindow):
        _check(w, _Cost, _cost)
    else:
        raise RecordError("bad_type", f"expected an AcceptanceWindow or CostWindow, got {type(w).__name__}")
