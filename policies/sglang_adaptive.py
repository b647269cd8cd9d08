"""``sglang_adaptive``: SGLang's adaptive speculative decoding (EMA of accepted drafts per batch-size slot).

Source: ``python/sglang/srt/speculative/adaptive_spec_params.py`` (sgl-project/sglang PR #21599):
``AdaptiveStepSlot.update`` keeps an EMA of the mean accepted drafts per request (``ema_alpha`` 0.2), waits
``warmup_batches`` (10), then every ``update_interval`` (5) batches ``_recompute_params`` walks the sorted
``candidate_steps``: down while ``ema <= prev_step - 0.5 + down_hysteresis`` (0.5 + hysteresis when the lower
step is 0), else up while ``ema > step - 0.5 + up_hysteresis``; from step 0 it probes the next step up.
``AdaptiveSpeculativeParams`` routes a batch to a per-batch-size slot; ``DEFAULT_ADAPTIVE_CONFIG`` gives slots
1/8/32/64 with candidate steps [1,3,5,7] / [0,1,3] / [0,1] / [0].

Adaptation to windows: SGLang feeds each verify's per-request accepted counts. We feed each cost window (it
carries the batch bucket) as ``rounds`` batches with the window's mean accepted per row,
``emitted / batch_rows - 1``; the EMA update over n identical batches is ``ema <- (1-a)^n ema + (1-(1-a)^n) x``.
"""

from __future__ import annotations

from typing import Any

from policies.base import Decision, Policy, Window
from telemetry.records import Bucket, CostWindow

# sglang DEFAULT_ADAPTIVE_CONFIG (adaptive_spec_params.py): per batch-size slot
DEFAULT_SLOTS: dict[int, dict[str, Any]] = {
    1: {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25},
    8: {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
    32: {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
    64: {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0},
}
EMA_ALPHA = 0.2  # AdaptiveStepSlot defaults
UPDATE_INTERVAL = 5
WARMUP_BATCHES = 10


def recompute_steps(steps: list[int], current: int, ema: float, down_h: float, up_h: float) -> int:
    """SGLang ``AdaptiveStepSlot._recompute_params`` (without the optional EMA ceiling)."""
    idx = steps.index(current)
    if current == 0:
        return steps[min(idx + 1, len(steps) - 1)]  # probe the smallest positive step after a nospec interval
    old = idx
    while idx > 0:
        prev = steps[idx - 1]
        drop = (0.5 if prev == 0 else prev - 0.5) + down_h
        if ema <= drop:
            idx -= 1
        else:
            break
    if idx == old:
        while idx < len(steps) - 1 and ema > steps[idx] - 0.5 + up_h:
            idx += 1
    return steps[idx]


class SGLangAdaptivePolicy(Policy):
    """SGLang's per-batch-size-slot EMA controller; one slot set per (versions, context bucket).

    Args:
        slots: ``{batch_size: {"candidate_steps": [...], "up_hysteresis": x, "down_hysteresis": y}}``
            (default: SGLang's ``DEFAULT_ADAPTIVE_CONFIG``); steps are clamped to ``k_max``.
        initial_k: SGLang's ``initial_steps`` (used when it is a slot candidate, else the middle candidate).
        ema_alpha, update_interval, warmup_batches: as in SGLang.
        k_max: see :class:`~policies.base.Policy`.
        seed: unused.
    """

    name = "sglang_adaptive"

    def __init__(self, slots: dict[int, dict[str, Any]] | None = None, initial_k: int = 3,
                 ema_alpha: float = EMA_ALPHA, update_interval: int = UPDATE_INTERVAL,
                 warmup_batches: int = WARMUP_BATCHES, k_max: int = 8, seed: int = 0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        cfg = slots if slots is not None else DEFAULT_SLOTS
        self.slots = {int(bs): {**c, "candidate_steps": sorted({min(int(s), k_max) for s in c["candidate_steps"]})}
                      for bs, c in cfg.items()}
        if not self.slots or any(not c["candidate_steps"] for c in self.slots.values()):
            raise ValueError("every slot needs at least one candidate step")
        self.initial_k, self.ema_alpha = initial_k, ema_alpha
        self.update_interval, self.warmup_batches = update_interval, warmup_batches
        self._state: dict[str, dict[str, float]] = {}  # "t|d|ctx|slot" -> {steps, ema, batches}

    def _slot(self, batch_size: int) -> int:
        """The smallest slot >= batch size, else the largest (SGLang pads to a CUDA-graph size, then routes)."""
        return min((s for s in self.slots if s >= batch_size), default=max(self.slots))

    def _get(self, key: str, slot: int) -> dict[str, float]:
        if key not in self._state:
            steps = self.slots[slot]["candidate_steps"]
            cur = self.initial_k if self.initial_k in steps else steps[len(steps) // 2]
            self._state[key] = {"steps": cur, "ema": float(cur - 1), "batches": 0}
        return self._state[key]

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        slot = self._slot(bucket.batch_bucket)
        key = f"{bucket.target_version}|{bucket.draft_version}|{bucket.context_bucket}|{slot}"
        st = self._state.get(key)
        if st is None:
            steps = self.slots[slot]["candidate_steps"]
            k = self.initial_k if self.initial_k in steps else steps[len(steps) // 2]
            return Decision(k=k, reason=f"slot {slot}: initial steps")
        return Decision(k=int(st["steps"]), reason=f"slot {slot}: ema_accept_len={st['ema']:.2f}")

    def _observe(self, window: Window) -> None:
        if not isinstance(window, CostWindow):
            return
        w = window
        slot = self._slot(w.batch_bucket)
        st = self._get(f"{w.target_version}|{w.draft_version}|{w.context_bucket}|{slot}", slot)
        if w.max_k != int(st["steps"]):
            return  # rounds run under another table say nothing about this slot's EMA
        if st["steps"] > 0:
            keep = (1.0 - self.ema_alpha) ** w.rounds
            st["ema"] = keep * st["ema"] + (1.0 - keep) * max(0.0, w.emitted / w.batch_rows - 1.0)
        before = st["batches"]
        st["batches"] = before + w.rounds
        crossed = (max(0, st["batches"] - self.warmup_batches) // self.update_interval
                   > max(0, before - self.warmup_batches) // self.update_interval)
        if st["batches"] > self.warmup_batches and crossed:
            c = self.slots[slot]
            new = recompute_steps(c["candidate_steps"], int(st["steps"]), st["ema"],
                                  float(c.get("down_hysteresis", -0.25)), float(c.get("up_hysteresis", 0.0)))
            if int(st["steps"]) == 0 and new > 0 and st["ema"] < 0:
                st["ema"] = float(new - 1)
            st["steps"] = new

    def _get_state(self) -> dict[str, Any]:
        return {"state": {k: dict(v) for k, v in self._state.items()}}

    def _set_state(self, state: dict[str, Any]) -> None:
        self._state = {str(k): {kk: float(vv) for kk, vv in v.items()} for k, v in state["state"].items()}
