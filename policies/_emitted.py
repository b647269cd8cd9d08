"""Emitted tokens per row as a cost cell measured them: the acceptance model corrected for the rows of the cell.

Why: the acceptance model (:mod:`policies._acceptance`) learns per (request type, context bucket) from each row's
own context, but a round is costed in the cell of its *longest* row (``telemetry/aggregate.py``), and an engine
with one k per batch asks the table there (``controller/engines/vllm/steps.py``). A batch of 16 rows with one long
prompt is decided in the long-context cell while fifteen of its rows are short ones, whose acceptance the
long-context buckets never saw. Measured (``spectune bench vllm``, xl + draft-v1, 2026-12-05): cell
(16, <=2048) at k = 5 emitted 2.91 tokens per row, while the <=2048 buckets (a tenth of the requests, the
structured ones among them accepting 76% of drafts) predicted 3.25; the policy held k = 5 there for 680 rounds
while k = 3 measured 648 tok/s against k = 5's 534.

Every cost window counts what its rounds emitted. In a window whose rows all drafted the round's k (one k per
batch, or a packed round whose rows chose the same k) that is the cell's own emitted tokens per row at k, whatever
mix of types and contexts shares its rounds. Rounds of one row are left out: there the acceptance model already
describes the very row, type by type, and a cell's measurement would only say which request happened to run. So,
per cell (model versions included: acceptance is a property of the pair) and k, this keeps decayed sums of rows and
accepted tokens, and corrects the acceptance model's mix-weighted prediction of accepted tokens per row the way
:class:`~policies._cost.CostModel` corrects its shared fit: a level for the cell (measured over predicted at the ks
measured, shrunk toward 1 with ``prior_windows``), then each measured k from its own measurement (shrunk toward the
levelled prediction the same way). Evidence counts windows, each weighted ``r / (r + 10)`` by its rounds, as the
cost model does: the rows of consecutive rounds are largely the same requests, so a window's rows do not measure
independently.

For Thompson sampling each k's correction in a measured cell is drawn log-normally with sigma
``spread * sqrt(prior / (n + prior))`` (``n`` its evidence): a k measured in one short exploration stays uncertain
and is tried again, a k measured for hours is not. A cell with no measurement keeps the acceptance model's draws.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from policies._cost import ROUNDS_PER_FULL_WINDOW
from telemetry.records import Cell


@dataclass(slots=True)
class EmittedSums:
    """Decayed sums over the windows of one (cell, k) in which every row drafted k."""

    rows: float = 0.0
    accepted: float = 0.0  # emitted minus rows: drafts accepted over every row and round
    windows: float = 0.0  # evidence in windows, each weighted r / (r + ROUNDS_PER_FULL_WINDOW)


SUM_FIELDS = tuple(f.name for f in fields(EmittedSums))


class EmittedCalibration:
    """Per (cell, k) emitted tokens per row, and the acceptance model's prediction corrected by them.

    Args:
        prior_windows: pseudo-windows of the acceptance model's prediction against a cell's measurements.
        decay: multiplier on a (cell, k)'s sums per window of the same (cell, k), for drift.
        spread: log-normal sigma of a Thompson draw's correction for a k never measured in the cell.
    """

    def __init__(self, prior_windows: float = 2.0, decay: float = 0.995, spread: float = 0.1) -> None:
        if prior_windows <= 0 or not 0 < decay <= 1 or spread < 0:
            raise ValueError("prior_windows must be > 0, decay in (0, 1] and spread >= 0")
        self.prior_windows, self.decay, self.spread = prior_windows, decay, spread
        self._sums: dict[Cell, dict[int, EmittedSums]] = {}

    def observe(self, cell: Cell, k: int, rounds: int, rows: int, drafted: float, emitted: float) -> bool:
        """Add one cost window (``drafted`` tokens over all its rows and rounds). Returns whether it was used:
        only windows in which every row drafted the round's k > 0 measure the cell at k, and only rounds of more
        than one row: a one-row round is the very row the acceptance model learnt at its own type and context, and
        what it emitted says only which request happened to run (in bench vllm's c1 phases that noise flipped the
        batch-1 cell between k = 3 and k = 5 every decision)."""
        if k <= 0 or rounds <= 0 or rows <= rounds or abs(drafted - rows * k) > 0.5:
            return False
        s = self._sums.setdefault(cell, {}).setdefault(k, EmittedSums())
        s.rows = s.rows * self.decay + rows
        s.accepted = s.accepted * self.decay + max(0.0, emitted - rows)
        s.windows = s.windows * self.decay + rounds / (rounds + ROUNDS_PER_FULL_WINDOW)
        return True

    def measured(self, cell: Cell) -> dict[int, tuple[float, float]]:
        """k -> (accepted tokens per row, evidence in windows) measured in the cell."""
        return {k: (s.accepted / s.rows, s.windows) for k, s in self._sums.get(cell, {}).items() if s.rows > 0}

    def adjust(self, cell: Cell, emitted: np.ndarray, mix: np.ndarray,
               rng: np.random.Generator | None = None) -> np.ndarray:
        """The acceptance model's emitted tokens corrected by the cell's measurements.

        Args:
            cell: the cost cell decided for.
            emitted: ``[T, K + 1]`` expected emitted tokens per row for each type and k (k = 0 gives 1).
            mix: ``[T]`` type weights of the cell's rows (normalised here).
            rng: with it, a Thompson draw of the correction.
        Returns:
            ``[T, K + 1]``: each k's accepted tokens (emitted minus 1) scaled by one factor for every type, so the
            mix-weighted emitted per row is the corrected one; clipped to ``[1, k + 1]``.
        """
        obs = {k: v for k, v in self.measured(cell).items() if k < emitted.shape[1]}
        if not obs:  # nothing measured: the acceptance model (and its own draws) stand
            return emitted
        w = np.asarray(mix, dtype=float)
        w = w / w.sum()
        pred = (w[:, None] * (emitted - 1.0)).sum(axis=0)  # [K + 1] accepted tokens per row, mix-weighted
        tau = self.prior_windows
        n = np.zeros(pred.size)  # [K + 1] evidence per k
        for k, (_, nk) in obs.items():
            n[k] = nk
        seen = sum(nk * acc for acc, nk in obs.values())
        expect = sum(nk * pred[k] for k, (_, nk) in obs.items())
        mean_pred = expect / max(n.sum(), 1e-12)
        adj = pred * (seen + tau * mean_pred) / max(expect + tau * mean_pred, 1e-12)  # the cell's level
        for k, (acc, nk) in obs.items():
            adj[k] = (nk * acc + tau * adj[k]) / (nk + tau)
        if rng is not None and self.spread > 0:
            sigma = self.spread * np.sqrt(tau / (n + tau))  # [K + 1]
            adj = adj * np.exp(sigma * rng.standard_normal(pred.size))
        factor = np.where(pred > 1e-12, adj / np.maximum(pred, 1e-12), 1.0)  # [K + 1]
        out = 1.0 + (emitted - 1.0) * factor[None, :]
        return np.clip(out, 1.0, 1.0 + np.arange(emitted.shape[1], dtype=float)[None, :])

    def forget(self, versions: tuple[str, str] | None = None, context_bucket: str | None = None) -> None:
        """Drop the cells of ``versions`` (every cell when None), only those of ``context_bucket`` when given."""
        for cell in [c for c in self._sums
                     if (versions is None or (c.target_version, c.draft_version) == versions)
                     and (context_bucket is None or c.context_bucket == context_bucket)]:
            del self._sums[cell]

    def get_state(self) -> list[dict[str, Any]]:
        return [{"cell": list(cell), "k": k, **asdict(s)} for cell, by_k in self._sums.items() for k, s in by_k.items()]

    def set_state(self, state: list[dict[str, Any]]) -> None:
        self._sums = {}
        for rec in state:
            t, d, bb, ctx = rec["cell"]
            sums = EmittedSums(**{f: float(rec[f]) for f in SUM_FIELDS})
            if not all(math.isfinite(getattr(sums, f)) and getattr(sums, f) >= 0 for f in SUM_FIELDS):
                raise ValueError(f"emitted calibration record with a negative or non-finite sum: {rec}")
            self._sums.setdefault(Cell(str(t), str(d), int(bb), str(ctx)), {})[int(rec["k"])] = sums
