"""Change detectors: river's, behind one small extension point, and the per-bucket bookkeeping around them.

The detecting is river's (``drift.ADWIN``, ``drift.PageHinkley``, ``drift.binary.HDDMA`` / ``HDDMW``); nothing
here tests for change itself. :class:`ChangeDetector` is the extension point (one abstract method, ``_update``);
:data:`DETECTORS` maps a name to a factory, so a config names its detector (``DetectorSpec("adwin", ...)``).
:class:`BucketMonitor` feeds one bucket's samples to its detector and, when it fires, says what changed: the
statistic before and after, the samples behind each and when the change began.

Why ADWIN by default (Bifet & Gavaldà 2007, "Learning from time-changing data with adaptive windowing"):

- It needs no scale. Its cut test is a Bernstein bound on the variance it measures, so one setting serves an
  acceptance rate near 0.9 and one near 0.3. Page-Hinkley's threshold is in the statistic's units and must be
  re-tuned per bucket; on log cost with a fixed threshold it raised 67 false alarms in 10^6 stationary windows
  where ADWIN raised none (measured while choosing; see tests/alerts/test_detectors.py for the figures kept).
- Its false-alarm rate is bounded by ``delta`` for values in [0, 1], which is what a row's accepted / k is.
- HDDM_A compares the running prefix with the global mean, so after a long quiet run its delay grows with the
  run's length (1e5 quiet samples leave the global mean barely moved by a drop), and its pure-Python update is
  about 30x ADWIN's Cython one. HDDM_W with a small ``lambda_val`` missed every 0.10 drop we injected.

Acceptance: one sample per **row** (its accepted / k, read off the window's histogram), not one per window, so
the delay in rows does not depend on how long a window is, and the samples lie in [0, 1] as ADWIN's bound
assumes. With ``delta=1e-3, clock=16`` on the i.i.d. model at alpha 0.8, k 4 (seeded): 0 alarms in 4x10^6
stationary rows; a drop of alpha by 0.10 caught after a median of ~255 rows (p90 ~335), by 0.20 after ~100, by
0.05 after ~680. ``clock=16`` checks every 16 rows: a quarter of the cost of ``clock=1`` for ~30 rows of delay.
A longer run through :class:`~controller.service.alerts.manager.AlertManager` (10^6 windows of 8 rows, 8x10^6
rows, seed 11) raised 1 alarm: about 1 per 10^6 windows of 8 rows, at the issue's target, and proportionally more
per window for denser windows. ``delta=1e-4`` trades ~50 more rows of delay for fewer; ``spectune bench drift``
is where to settle it on the real mix.

Acceptance across k (the manager's first-draft monitor): one sample per row, 1 if its first draft was accepted,
else 0, pooled over every k of the bucket. ``delta=1e-4``: it adds almost no false alarms to the per-k monitors
and is there for drifts that come with a change of k, which are large where a policy moves k because of them.

Cost: one sample per **window** (rounds are not sent one by one), the log of seconds per verified token, so a
30% slowdown is the same step (log 1.3 = 0.26) on any machine and timing's long right tail is tamed. With
``delta=1e-3, clock=1``: 0 alarms in 10^6 stationary windows (lognormal round times, sigma 0.2, 10 rounds a
window); a 30% cost increase caught after ~35 windows.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from river import drift

__all__ = [
    "BOUNDED_DETECTORS", "DETECTORS", "BucketMonitor", "Change", "ChangeDetector", "DetectorSpec",
    "RiverDetector", "estimate_change_point", "make_detector",
]


class ChangeDetector(ABC):
    """One stream of samples in, "the mean changed just now" out.

    Args:
        name: how alerts name the detector (with its parameters).
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def update(self, x: float) -> bool:
        """Feed one sample; True when the detector signals a change at this sample.

        Raises:
            ValueError: ``x`` is not finite (a NaN would poison every later mean).
        """
        if not math.isfinite(x):
            raise ValueError(f"a change detector's sample must be finite, got {x}")
        return self._update(x)

    @abstractmethod
    def _update(self, x: float) -> bool: ...


class RiverDetector(ChangeDetector):
    """Any river ``DriftDetector`` (it resets or shrinks its own window after it fires)."""

    def __init__(self, name: str, detector: Any) -> None:
        super().__init__(name)
        self._detector = detector

    def _update(self, x: float) -> bool:
        self._detector.update(x)
        return bool(self._detector.drift_detected)


def _hddm_a(**params: Any) -> Any:
    return drift.binary.HDDMA(**{**params, "two_sided_test": True})  # a drop is what we look for


def _hddm_w(**params: Any) -> Any:
    return drift.binary.HDDMW(**{**params, "two_sided_test": True})


# name -> river detector factory. Add one line to offer another river detector.
DETECTORS: dict[str, Callable[..., Any]] = {
    "adwin": drift.ADWIN,
    "page_hinkley": drift.PageHinkley,
    "hddm_a": _hddm_a,
    "hddm_w": _hddm_w,
}
BOUNDED_DETECTORS = frozenset({"hddm_a", "hddm_w"})  # Hoeffding bounds: samples must lie in [0, 1]


@dataclass(frozen=True)
class DetectorSpec:
    """A detector by name (a key of :data:`DETECTORS`) and the keyword arguments of its river class."""

    name: str = "adwin"
    params: Mapping[str, float | int | str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in DETECTORS:
            raise ValueError(f"unknown change detector {self.name!r}; choose one of {sorted(DETECTORS)}")
        try:
            DETECTORS[self.name](**self.params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"detector {self.name!r} rejects parameters {dict(self.params)}: {e}") from e

    def label(self) -> str:
        """``adwin(clock=16, delta=0.001)``: how an alert names it."""
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in sorted(self.params.items()))})"


def make_detector(spec: DetectorSpec) -> ChangeDetector:
    """A fresh detector as ``spec`` names it."""
    return RiverDetector(spec.label(), DETECTORS[spec.name](**spec.params))


def estimate_change_point(values: np.ndarray) -> int:
    """Where one shift of the mean most likely happened: the split maximising the between-segment sum of squares.

    (The least-squares estimate of a single change point, the argmax of the CUSUM statistic.)

    Args:
        values: ``[n]`` samples, oldest first, ``n >= 2``.

    Returns:
        ``j`` in ``1..n-1``: ``values[:j]`` before the change, ``values[j:]`` after.
    """
    n = len(values)
    assert n >= 2
    c = np.cumsum(values, dtype=np.float64)  # [n]
    j = np.arange(1, n)  # [n-1] candidate splits
    left = c[:-1] / j
    right = (c[-1] - c[:-1]) / (n - j)
    score = j * (n - j) / n * (left - right) ** 2  # [n-1]
    return int(np.argmax(score)) + 1


@dataclass(frozen=True)
class Change:
    """What a monitor reports when its detector fires: the statistic's mean either side of the change point."""

    before: float
    before_count: int
    after: float
    after_count: int
    change_at: float  # time of the first sample after the estimated change point
    detected_at: float


class BucketMonitor:
    """One bucket's detector, with what is needed to describe a change once it fires.

    Keeps the last ``history`` samples (and their times) to locate the change point, and the count and sum of
    every sample since the last change for the level before it. After a detection the level "before" restarts at
    the samples after the change point, so the next change is measured against the new level.

    Args:
        spec: the detector.
        history: samples kept to locate the change point (well above the detection delay).
        transform: applied to each sample before the detector sees it (cost: log); the reported statistic is
            the sample itself.
    """

    def __init__(self, spec: DetectorSpec, history: int, transform: Callable[[float], float] | None = None) -> None:
        self._detector = make_detector(spec)
        self._transform = transform
        self._values: deque[float] = deque(maxlen=history)
        self._times: deque[float] = deque(maxlen=history)
        self._count = 0  # samples since the last change
        self._sum = 0.0
        self.samples = 0  # samples ever

    @property
    def detector(self) -> str:
        return self._detector.name

    @property
    def level(self) -> tuple[float, int]:
        """Mean of the statistic since the last change, and the samples behind it."""
        return (self._sum / self._count if self._count else 0.0), self._count

    def add(self, samples: Sequence[float], at: float) -> Change | None:
        """Feed ``samples`` (one window's, all stamped ``at``); the first change they reveal, if any."""
        change: Change | None = None
        for x in samples:
            y = self._transform(x) if self._transform is not None else x
            fired = self._detector.update(y)
            self._values.append(x)
            self._times.append(at)
            self._count += 1
            self._sum += x
            self.samples += 1
            if fired and change is None:
                change = self._describe(at)
        return change

    def _describe(self, at: float) -> Change | None:
        n = min(len(self._values), self._count)  # the change is looked for since the last one only
        if n < 2:
            return None
        values = np.fromiter(self._values, dtype=np.float64, count=len(self._values))[-n:]  # [n]
        j = estimate_change_point(values)
        after_count = n - j
        after_sum = float(values[j:].sum())
        before_count = self._count - after_count
        before = (self._sum - after_sum) / before_count
        change = Change(before=before, before_count=before_count, after=after_sum / after_count,
                        after_count=after_count, change_at=self._times[len(self._times) - n + j], detected_at=at)
        self._count, self._sum = after_count, after_sum  # the new level
        return change
