"""The extension point every policy implements.

A **policy** decides k (0 = speculation off) for a :class:`~telemetry.records.Bucket` and learns from the
acceptance and cost windows telemetry delivers. The public methods do the shared work (input validation,
burn-in, clamping k to ``[0, k_max]``, snapshot versioning) and call the private hooks ``_decide``,
``_observe``, ``_get_state`` / ``_set_state``. Learned state lives in ``_underscore`` attributes; constructor
arguments are the hyper-parameters; every policy owns a seeded ``numpy.random.Generator``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, ClassVar

import numpy as np

from telemetry.records import (
    MAX_DRAFT_LEN,
    AcceptanceWindow,
    Bucket,
    CostWindow,
    PolicyTable,
    RecordError,
)
from telemetry.wire import check_window

SNAPSHOT_VERSION = 4  # bump when a snapshot's shape changes; restore() rejects other versions
Window = AcceptanceWindow | CostWindow


class DecisionKind(Enum):
    """Which rule produced a decision: what tests, metrics and operators branch on (``reason`` is prose)."""

    RULE = "rule"  # a fixed rule or heuristic of a policy that keeps no incumbent (static k, a schedule)
    BURN_IN = "burn_in"  # too few windows observed yet: the configured burn-in k
    FIRST = "first"  # the first choice for a bucket
    BEST = "best"  # the current best guess, unchanged
    HOLD = "hold"  # the incumbent, kept for a while after a switch whatever the estimates say
    SWITCH = "switch"  # the incumbent changed to another k
    OFF = "off"  # the incumbent changed to k = 0: speculation turned off
    EXPLORE = "explore"  # a k other than the best guess, served to measure it
    PROBE = "probe"  # a second k served once in a cell measured at one k only, to learn its cost slope
    PROBE_OFF = "probe_off"  # k = 0 served once to measure it before speculation may be turned off
    REPROBE = "reprobe"  # speculation served once in a cell that has been off for a while


@dataclass(frozen=True)
class Decision:
    """What a policy chose for one bucket, and why."""

    k: int  # draft length for rows of the bucket (0 = speculation off)
    expected_goodput: dict[int, float] = field(default_factory=dict)  # candidate k -> expected tokens/s (if modelled)
    exploring: bool = False  # True when k is not the policy's current best guess (exploration or probe)
    reason: str = ""  # short human-readable why, for operators and logs
    kind: DecisionKind = DecisionKind.RULE  # the rule that chose k, for code that branches on it


class Policy(ABC):
    """Base class: decide k per bucket, learn from windows, snapshot to plain JSON-safe dicts.

    Args:
        k_max: largest draft length this policy may choose (<= ``MAX_DRAFT_LEN``).
        seed: seed of the policy's own random generator (no global random state anywhere).
        burn_in_windows: windows to observe before deciding freely; until then ``burn_in_k`` is returned.
        burn_in_k: k used during burn-in (clamped to ``[0, k_max]``).
    """

    name: ClassVar[str] = "base"

    def __init__(self, k_max: int = 8, seed: int = 0, burn_in_windows: int = 0, burn_in_k: int = 1) -> None:
        if not 0 <= k_max <= MAX_DRAFT_LEN:
            raise ValueError(f"k_max must be in [0, {MAX_DRAFT_LEN}], got {k_max}")
        if burn_in_windows < 0:
            raise ValueError(f"burn_in_windows must be >= 0, got {burn_in_windows}")
        self.k_max = k_max
        self.seed = seed
        self.burn_in_windows = burn_in_windows
        self.burn_in_k = burn_in_k
        self._rng = np.random.default_rng(seed)
        self._n_windows = 0

    # ------------------------------------------------------------------------------------------- public API
    def decide(self, bucket: Bucket, explore: bool = True) -> Decision:
        """Choose k for rows of ``bucket``. Never raises for an unknown bucket: policies fall back to broader ones.

        Args:
            bucket: the bucket to decide for.
            explore: False asks for the current best guess without exploration or state changes (tables).
        """
        if not isinstance(bucket, Bucket):
            raise RecordError("bad_type", f"decide() takes a Bucket, got {type(bucket).__name__}")
        if self._n_windows < self.burn_in_windows:
            return Decision(k=self._clamp(self.burn_in_k), exploring=True, reason="burn-in", kind=DecisionKind.BURN_IN)
        d = self._decide(bucket, explore)
        k = self._clamp(d.k)
        if k != d.k:
            d = replace(d, k=k, reason=d.reason + "; clamped")
        return d

    def observe(self, window: Window) -> None:
        """Validate a window and learn from it. Garbage raises :class:`RecordError` naming what is wrong."""
        if isinstance(window, AcceptanceWindow):
            check_window(window)  # the wire's rules (k within MAX_DRAFT_LEN, plausible tallies among them)
        elif isinstance(window, CostWindow):
            check_window(window)
            if window.rounds <= 0 or window.batch_rows <= 0:
                raise RecordError("empty_window", "cost window with no rounds; drop it before observe()")
        else:
            got = type(window).__name__
            raise RecordError("bad_type", f"observe() takes AcceptanceWindow or CostWindow, got {got}")
        self._n_windows += 1
        self._observe(window)

    def snapshot(self) -> dict[str, Any]:
        """Plain, versioned, JSON-safe state (hyper-parameters, learned state and the RNG position)."""
        return {
            "policy": self.name,
            "snapshot_version": SNAPSHOT_VERSION,
            "k_max": self.k_max,
            "n_windows": self._n_windows,
            "rng": _jsonable(self._rng.bit_generator.state),
            "state": self._get_state(),
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Load a :meth:`snapshot` taken from a policy of the same class and ``k_max``."""
        if not isinstance(snap, dict):
            raise RecordError("bad_type", "snapshot must be a dict")
        if snap.get("policy") != self.name:
            raise RecordError("wrong_policy", f"snapshot of {snap.get('policy')!r} cannot restore {self.name!r}")
        if snap.get("snapshot_version") != SNAPSHOT_VERSION:
            raise RecordError(
                "unknown_snapshot_version",
                f"snapshot_version={snap.get('snapshot_version')!r}, this build reads {SNAPSHOT_VERSION}; "
                "start the policy cold or restore with the build that wrote it",
            )
        if snap.get("k_max") != self.k_max:
            raise RecordError("k_max_mismatch", f"snapshot k_max={snap.get('k_max')} != policy k_max={self.k_max}")
        try:
            self._rng.bit_generator.state = snap["rng"]
            self._n_windows = int(snap["n_windows"])
            self._set_state(snap["state"])
        except (KeyError, TypeError, ValueError) as e:
            raise RecordError("bad_snapshot", f"snapshot is malformed: {e!r}") from e

    def reopen(self, target_version: str, draft_version: str, request_type: str, context_bucket: str) -> None:
        """Acceptance moved in this acceptance bucket (an ``acceptance_drift`` alert): widen its exploration again,
        so the policy re-converges on the new level instead of trusting what it learnt before the change.

        What that means is the policy's (:meth:`_reopen`; default: nothing, for policies that learn nothing or
        forget on their own). k and every other bucket are left as they are.
        """
        for name, v in (("target_version", target_version), ("draft_version", draft_version),
                        ("request_type", request_type), ("context_bucket", context_bucket)):
            if not isinstance(v, str) or not v:
                raise RecordError("bad_type", f"reopen() needs {name} as a non-empty string, got {v!r}")
        self._reopen(target_version, draft_version, request_type, context_bucket)

    def forget(self, *, request_type: str | None = None, versions: tuple[str, str] | None = None) -> None:
        """Drop what was learnt about a request type (under every version pair) or a (target, draft) version pair:
        the sidecar no longer tracks it (a label that lost its place under a cap), so its state must not grow
        memory or weigh in joint decisions. Exactly one of the two is given. Default: nothing to drop.
        """
        if (request_type is None) == (versions is None):
            raise ValueError("forget() takes exactly one of request_type and versions")
        self._forget(request_type, versions)

    def table(self, buckets: Iterable[Bucket], version: int, reason: str = "") -> PolicyTable:
        """Project the current best guesses (no exploration) onto a :class:`PolicyTable`."""
        entries = {b.key(): self.decide(b, explore=False).k for b in buckets}
        ks = list(entries.values())
        default_k = max(set(ks), key=lambda k: (ks.count(k), -k)) if ks else 0
        return PolicyTable(version=version, default_k=default_k, k_max=self.k_max, entries=entries,
                           reason=reason or f"{self.name} policy")

    # ------------------------------------------------------------------------------------------- hooks
    @abstractmethod
    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        """The policy's choice; the base clamps it."""

    def _observe(self, window: Window) -> None:  # noqa: B027 - static policies learn nothing
        """Learn from a validated window (default: nothing)."""

    def _reopen(self, target_version: str, draft_version: str, request_type: str,  # noqa: B027 - optional hook
                context_bucket: str) -> None:
        """Widen exploration of one acceptance bucket after a drift (default: nothing)."""

    def _forget(self, request_type: str | None,  # noqa: B027 - optional hook
                versions: tuple[str, str] | None) -> None:
        """Drop a request type's or a version pair's learnt state (default: nothing)."""

    @abstractmethod
    def _get_state(self) -> dict[str, Any]:
        """Learned state as JSON-safe plain data."""

    @abstractmethod
    def _set_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`_get_state`."""

    # ------------------------------------------------------------------------------------------- helpers
    def _clamp(self, k: int) -> int:
        return int(min(max(int(k), 0), self.k_max))


def _jsonable(x: Any) -> Any:
    """numpy scalars/arrays and tuples -> plain Python, recursively; non-finite floats are rejected."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating | float):
        if not math.isfinite(float(x)):
            raise ValueError("non-finite value in snapshot")
        return float(x)
    return x
