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
rows, seed 11) raised 1 alarm: about 1 per 10^6 windows of 8 rows, at the limit ``spectune bench drift`` sets
(at most 1 false alarm per 10^6 rounds), and proportionally more per window for denser windows. ``delta=1e-4``
trades ~50 more rows of delay for fewer; ``spectune bench drift`` is where to settle it on the real mix.

Those figures are for i.i.d. rows. An engine's rows come in requests that each keep their own acceptance, so the
manager's acceptance monitors confirm every detection across windows before it is raised (:class:`BucketMonitor`,
:func:`stretch_z`); the delays above grow by the confirmation's windows.

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
from scipy import stats

__all__ = [
    "BOUNDED_DETECTORS", "DETECTORS", "BucketMonitor", "Change", "ChangeDetector", "DetectorSpec",
    "RiverDetector", "estimate_change_point", "make_detector", "stretch_z",
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
    """What a monitor reports when its detector fires: the statistic's mean either side of the change point.

    ``confirmed`` False: a monitor that confirms changes across windows (``confirm_windows``) found the shift
    did not hold; the level was left where it was and the caller should not raise it.
    """

    before: float
    before_count: int
    after: float
    after_count: int
    change_at: float  # time of the first sample after the estimated change point
    detected_at: float
    confirmed: bool = True
    z: float | None = None  # the confirmation's statistic (:func:`stretch_z`), when the change was tested


MIN_REFERENCE_STRETCHES = 4  # stretches of the level before a change that a confirmation compares against
CONFIRM_TESTS = 4  # a held detection is tested after every confirm_windows windows, at most this many times


def stretch_z(before: np.ndarray, after: np.ndarray, stretch: int) -> float | None:
    """How far the level after a change lies from the level before it, in units of the level's own swings.

    ``before`` is cut, newest first, into consecutive stretches of ``stretch`` windows (shorter when it cannot
    hold :data:`MIN_REFERENCE_STRETCHES` of them: shorter stretches swing more, so that errs towards no alert).
    Each stretch's mean is one draw of what the level does over that time scale, and stretches are taken as
    independent of each other (a stretch outlasts the requests in it). ``after`` spans ``len(after) / stretch``
    such stretches. The statistic is ``|mean(after) - mean(before)|`` over the standard deviation of stretch
    means times ``sqrt(1 / stretches after + 1 / stretches before)``: a two-sample t statistic whose unit is a
    stretch, not a row. So the bucket's own history sets the yardstick: a bucket whose level swings with
    whichever requests are decoding has wide stretches, and a shift as large as its usual swings is not a change.

    Args:
        before: ``[W_b, 2]`` per window (rows, sum of the statistic), oldest first.
        after: ``[W_a, 2]`` the same for the windows after the change point.
        stretch: windows per stretch.
    Returns:
        The statistic as a normal deviate (below), or None when ``before`` holds fewer than
        :data:`MIN_REFERENCE_STRETCHES` stretches or ``after`` has no rows.
    """
    w = min(stretch, len(before) // MIN_REFERENCE_STRETCHES)
    if w < 1 or len(after) == 0 or after[:, 0].sum() <= 0:
        return None
    n = len(before) // w
    blocks = before[len(before) - n * w:].reshape(n, w, 2).sum(axis=1)  # [n, 2] rows and sums per stretch
    blocks = blocks[blocks[:, 0] > 0]
    if len(blocks) < MIN_REFERENCE_STRETCHES:
        return None
    means = blocks[:, 1] / blocks[:, 0]  # [n']
    level = float(before[:, 1].sum() / before[:, 0].sum())
    sd = float(means.std(ddof=1)) * math.sqrt(w / len(after) + 1.0 / len(means))
    shift = abs(float(after[:, 1].sum() / after[:, 0].sum()) - level)
    if sd <= 0:
        return math.inf if shift > 0 else 0.0
    # A few stretches estimate their spread loosely: the t statistic's tail with n' - 1 degrees of freedom, told
    # as the normal deviate of the same tail, so one threshold means one false-alarm chance at any history length.
    return float(stats.norm.isf(stats.t.sf(shift / sd, df=len(means) - 1)))


class BucketMonitor:
    """One bucket's detector, with what is needed to describe a change once it fires.

    Keeps the last ``history`` samples (their times and windows) to locate the change point, and the count and sum
    of every sample since the last change for the level before it. After a change the level "before" restarts at
    the samples after the change point, so the next change is measured against the new level.

    **Confirmation across windows** (``confirm_windows`` > 0). The detector takes samples as independent; rows
    of one request are not (a request the draft predicts perfectly yields dozens of rows at 1.0), and at low load
    a bucket's level for a second or two is whichever one or two requests are decoding. Rows recorded from the xl
    engine at a steady load (4, then 16; static k=3; 0.25 s windows; 6 minutes where nothing changed), replayed
    without a cool-down: ADWIN on rows raised 32-40 "changes" per seed. So a detection is held until
    ``confirm_windows`` more windows have arrived; then the change point is located again, and the windows after
    it are compared with stretches of ``confirm_windows`` windows before it (:func:`stretch_z`, a t test whose
    unit is a stretch): the change is confirmed when the statistic reaches ``confirm_z``. A shift that was one
    request passing through has faded by then or is as large as the bucket's usual swings; a new level holds.
    A shift between half the threshold and the threshold stays held and is tested again after every
    ``confirm_windows`` windows (up to :data:`CONFIRM_TESTS` tests): a real change clears the threshold as the
    windows after it add up, while a passing request fades. An unconfirmed detection leaves the level as it was
    and rebuilds the detector from the kept samples of the level, so a real change that was not yet clear is
    detected and tested again. The reference needs :data:`MIN_REFERENCE_STRETCHES` stretches of windows, so a
    bucket counts as young by windows, not rows, and a machine slowed by contention (fewer rows per window)
    reaches it as soon as an idle one. Detections while one is held are absorbed into it.

    Args:
        spec: the detector.
        history: samples kept to locate the change point (well above the detection delay).
        transform: applied to each sample before the detector sees it (cost: log); the reported statistic is
            the sample itself.
        confirm_windows: windows a detection is held before the test across windows (0: report at once).
        confirm_z: the test's threshold (a normal deviate, see :func:`stretch_z`).
        window_history: per-window (rows, sum) kept for the test's reference stretches.
    """

    def __init__(self, spec: DetectorSpec, history: int, transform: Callable[[float], float] | None = None,
                 confirm_windows: int = 0, confirm_z: float = 4.0, window_history: int = 512) -> None:
        if confirm_windows < 0 or confirm_z <= 0 or window_history < 2:
            raise ValueError("confirm_windows must be >= 0, confirm_z > 0 and window_history >= 2")
        self._spec = spec
        self._detector = make_detector(spec)
        self._transform = transform
        self._confirm_windows, self._confirm_z = confirm_windows, confirm_z
        self._values: deque[float] = deque(maxlen=history)
        self._times: deque[float] = deque(maxlen=history)
        self._windows: deque[int] = deque(maxlen=history)  # which add() call each kept sample came in
        self._window = 0  # add() calls so far
        self._per_window: deque[tuple[int, int, float]] = deque(maxlen=window_history)  # (window, rows, sum)
        self._level_since = 1  # first window of the current level
        self._held: int | None = None  # windows since a detection that awaits confirmation
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
        """Feed ``samples`` (one window's, all stamped ``at``); the change they reveal or confirm, if any."""
        change: Change | None = None
        fired_here = False
        self._window += 1
        for x in samples:
            y = self._transform(x) if self._transform is not None else x
            fired = self._detector.update(y)
            self._values.append(x)
            self._times.append(at)
            self._windows.append(self._window)
            self._count += 1
            self._sum += x
            self.samples += 1
            if fired and not fired_here and self._held is None:
                fired_here = True
                if self._confirm_windows:
                    self._held = 0
                else:
                    change = self._describe(at)
        if not samples:
            return change
        self._per_window.append((self._window, len(samples), float(sum(samples))))
        if self._held is None or fired_here:
            return change
        self._held += 1
        if self._held % self._confirm_windows:
            return None
        change = self._describe(at, test=True)
        if (change is not None and not change.confirmed and change.z is not None
                and change.z >= self._confirm_z / 2 and self._held < CONFIRM_TESTS * self._confirm_windows):
            return None  # a shift that holds but is not yet clear of the usual swings: look again later
        self._held = None
        if change is None or not change.confirmed:
            self._rebuild()
        return change

    def _rebuild(self) -> None:
        """After an unconfirmed detection: a fresh detector fed the kept samples of the current level.

        The detector dropped the level before its detection when it fired; without this, a real change that was
        not yet clear at its test would be the detector's new normal and never be reported.
        """
        self._detector = make_detector(self._spec)
        n = min(len(self._values), self._count)
        for x in list(self._values)[len(self._values) - n:]:
            self._detector.update(self._transform(x) if self._transform is not None else x)

    def _describe(self, at: float, test: bool = False) -> Change | None:
        n = min(len(self._values), self._count)  # the change is looked for since the last one only
        if n < 2:
            return None
        values = np.fromiter(self._values, dtype=np.float64, count=len(self._values))[-n:]  # [n]
        j = estimate_change_point(values)
        after_count = n - j
        after_sum = float(values[j:].sum())
        before_count = self._count - after_count
        before = (self._sum - after_sum) / before_count
        first_after = self._windows[len(self._windows) - n + j]  # the window the change point lies in
        z = None
        if test:
            kept = np.array([(w, c, x) for w, c, x in self._per_window if w >= self._level_since])  # [W, 3]
            after = kept[:, 0] >= first_after
            z = stretch_z(kept[~after, 1:], kept[after, 1:], self._confirm_windows)
        change = Change(before=before, before_count=before_count, after=after_sum / after_count,
                        after_count=after_count, change_at=self._times[len(self._times) - n + j], detected_at=at,
                        confirmed=not test or (z is not None and z >= self._confirm_z), z=z)
        if change.confirmed:
            self._count, self._sum = after_count, after_sum  # the new level
            self._level_since = first_after
        return change
