"""``sglang_adaptive``: SGLang's adaptive speculative decoding (``--speculative-adaptive``), EMA of accepted drafts.

Source: ``python/sglang/srt/speculative/adaptive_spec_params.py`` (sgl-project/sglang PR #21599, batch-size slots
from PR #24055). ``AdaptiveStepSlot.update`` keeps ``ema_accept_len``, an EMA (``ema_alpha`` 0.2) of the mean
accepted drafts per request of each verified batch (not counting the bonus token), started at
``current_steps - 1``; it is not updated while the slot runs 0 steps. After ``warmup_batches`` (10) batches,
every ``update_interval``-th (5) batch runs ``_recompute_params`` over the sorted ``candidate_steps``:

- from 0 steps: probe the next candidate up (and start its EMA at ``target - 1`` if the EMA is still negative);
- else move **down** while ``ema <= prev - 0.5 + down_hysteresis`` (``0.5 + down_hysteresis`` when the lower
  candidate ``prev`` is 0), where ``prev`` is the candidate below the current one;
- and only if it did not move down, move **up** while ``ema > current - 0.5 + up_hysteresis``.

So with the defaults (down -0.25, up 0.0) and candidates [1, 3, 7], 3 drops to 1 at ``ema <= 0.25`` and rises
to 7 at ``ema > 2.5``; 7 drops to 3 at ``ema <= 2.25``. The optional EMA ceiling (``ceiling_coeff``) is 0 in
every SGLang default and is left out. ``AdaptiveSpeculativeParams._find_closest_bs`` routes a batch to the slot
with the **largest key <= batch size** (keys are lower bounds; below the smallest key, the smallest slot).

Adaptation to windows: SGLang feeds each verified batch. We feed a cost window (it carries the batch bucket) as
``rounds`` batches each with the window's mean accepted per row, ``emitted / batch_rows - 1``, stepping to each
recompute point in turn (``n`` identical batches move the EMA to ``(1-a)^n ema + (1-(1-a)^n) x``). A one-round
window is exactly one SGLang batch. Batches of a window that was served at another k than the slot's current
steps (an older table, or the rest of a window after a recompute changed the steps) are not fed. Slots are kept
per (versions): SGLang keeps one set per server, and a model update restarts it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from policies.base import Decision, DecisionKind, Policy, Window
from telemetry.records import Bucket, CostWindow

EMA_ALPHA = 0.2  # AdaptiveStepSlot defaults
UPDATE_INTERVAL = 5
WARMUP_BATCHES = 10
DOWN_HYSTERESIS = -0.25
UP_HYSTERESIS = 0.0
INITIAL_STEPS = 3  # SGLang's --speculative-num-steps, what the slot starts from when it is a candidate
ZERO_DROP_THRESHOLD = 0.5  # the drop threshold to a 0-step candidate (before hysteresis)


@dataclass(frozen=True)
class SlotConfig:
    """One batch-size slot of SGLang's adaptive config (an entry of its JSON)."""

    candidate_steps: tuple[int, ...]  # the draft lengths this slot may run, strictly increasing
    up_hysteresis: float = UP_HYSTERESIS  # added to the rise threshold ``current - 0.5``
    down_hysteresis: float = DOWN_HYSTERESIS  # added to the drop threshold ``prev - 0.5``

    def __post_init__(self) -> None:
        s = self.candidate_steps
        if not s or any(x < 0 for x in s) or list(s) != sorted(set(s)):
            raise ValueError(f"candidate_steps must be non-empty, >= 0 and strictly increasing, got {s}")


@dataclass(frozen=True)
class SGLangAdaptiveConfig:
    """SGLang's adaptive config: slots keyed by their lowest batch size, and the EMA schedule."""

    slots: Mapping[int, SlotConfig] = field(default_factory=lambda: {1: SlotConfig((1, 3, 7))})
    initial_steps: int = INITIAL_STEPS  # used when a candidate of the slot, else the slot's middle candidate
    ema_alpha: float = EMA_ALPHA  # weight of the newest batch in the EMA
    update_interval: int = UPDATE_INTERVAL  # batches between recomputes after warm-up
    warmup_batches: int = WARMUP_BATCHES  # batches before the first recompute may count

    def __post_init__(self) -> None:
        if not self.slots or any(bs < 1 for bs in self.slots):
            raise ValueError(f"slots need at least one key, each a batch size >= 1, got {sorted(self.slots)}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.update_interval < 1 or self.warmup_batches < 0:
            raise ValueError("update_interval must be >= 1 and warmup_batches >= 0")


PRESETS: dict[str, SGLangAdaptiveConfig] = {
    # PR #21599's single candidate set, one slot for every batch size.
    "single": SGLangAdaptiveConfig(),
    # Batch-size aware: [1, 64) -> [1, 3, 7]; [64, 128) -> [1, 2, 5]; >= 128 -> [1, 2, 6].
    "bs_aware": SGLangAdaptiveConfig(slots={1: SlotConfig((1, 3, 7)), 64: SlotConfig((1, 2, 5)),
                                            128: SlotConfig((1, 2, 6))}),
    # Upstream's DEFAULT_ADAPTIVE_CONFIG today (adaptive_spec_params.py): speculation off from batch 64.
    "upstream_default": SGLangAdaptiveConfig(slots={
        1: SlotConfig((1, 3, 5, 7)),
        8: SlotConfig((0, 1, 3), down_hysteresis=0.0),
        32: SlotConfig((0, 1), down_hysteresis=0.0),
        64: SlotConfig((0,), down_hysteresis=0.0),
    }),
}

SlotKey = tuple[str, str, int]  # (target version, draft version, slot's lowest batch size)


@dataclass(frozen=True)
class SlotState:
    """``AdaptiveStepSlot``'s learned state."""

    steps: int  # current_steps: the draft length the slot runs
    ema: float  # ema_accept_len: EMA of mean accepted drafts per request (bonus token not counted)
    batches: int  # _batch_count: batches fed so far


def recompute_steps(steps: tuple[int, ...], current: int, ema: float, down_h: float, up_h: float) -> int:
    """SGLang ``AdaptiveStepSlot._recompute_params`` (without the EMA ceiling, 0 in every SGLang default).

    Args:
        steps: the slot's candidate steps, strictly increasing.
        current: the slot's current steps (one of ``steps``).
        ema: the slot's ``ema_accept_len``.
        down_h, up_h: the slot's hysteresis.
    """
    idx = steps.index(current)
    if current == 0:
        return steps[min(idx + 1, len(steps) - 1)]  # probe the smallest positive step after a nospec interval
    old = idx
    while idx > 0:
        prev = steps[idx - 1]
        drop = (ZERO_DROP_THRESHOLD if prev == 0 else prev - 0.5) + down_h
        if ema > drop:
            break
        idx -= 1
    if idx == old:  # moved up only if it did not move down
        while idx < len(steps) - 1 and ema > steps[idx] - 0.5 + up_h:
            idx += 1
    return steps[idx]


def batches_to_recompute(batches: int, warmup: int, interval: int) -> int:
    """Batches from a count of ``batches`` to the next one that recomputes (``count > warmup`` and
    ``(count - warmup) % interval == 0``)."""
    if batches < warmup:
        return warmup + interval - batches
    return interval - (batches - warmup) % interval


class SGLangAdaptivePolicy(Policy):
    """SGLang's per-batch-size-slot EMA controller; one slot set per (target, draft) versions.

    Args:
        config: slots and EMA schedule (default: ``PRESETS["single"]``, candidates [1, 3, 7]); candidate steps
            above ``k_max`` are clamped to it.
        k_max: see :class:`~policies.base.Policy`.
        seed: unused (deterministic rule).
    """

    name = "sglang_adaptive"
    default_config: SGLangAdaptiveConfig = PRESETS["single"]

    def __init__(self, config: SGLangAdaptiveConfig | None = None, k_max: int = 8, seed: int = 0) -> None:
        super().__init__(k_max=k_max, seed=seed)
        self.config = config if config is not None else self.default_config
        self._keys = sorted(self.config.slots)
        # candidate steps per slot, clamped to k_max (SGLang sizes its buffers to its own largest candidate)
        self._steps = {bs: tuple(sorted({min(s, k_max) for s in c.candidate_steps}))
                       for bs, c in self.config.slots.items()}
        self._state: dict[SlotKey, SlotState] = {}

    def slot_of(self, batch_size: int) -> int:
        """The slot with the largest key <= batch size, else the smallest (SGLang ``_find_closest_bs``)."""
        return self._keys[max(0, bisect_right(self._keys, batch_size) - 1)]

    def _initial(self, slot: int) -> SlotState:
        steps = self._steps[slot]
        cur = self.config.initial_steps if self.config.initial_steps in steps else steps[len(steps) // 2]
        return SlotState(steps=cur, ema=float(cur - 1), batches=0)

    def _decide(self, bucket: Bucket, explore: bool) -> Decision:
        slot = self.slot_of(bucket.batch_bucket)
        st = self._state.get((bucket.target_version, bucket.draft_version, slot))
        if st is None:
            return Decision(k=self._initial(slot).steps, reason=f"slot {slot}: initial steps", kind=DecisionKind.FIRST)
        return Decision(k=st.steps, reason=f"slot {slot}: ema_accept_len={st.ema:.2f}", kind=DecisionKind.RULE)

    def _observe(self, window: Window) -> None:
        if not isinstance(window, CostWindow):
            return
        w = window
        slot = self.slot_of(w.batch_bucket)
        key = (w.target_version, w.draft_version, slot)
        st = self._state.get(key) or self._initial(slot)
        if w.max_k == st.steps:
            self._state[key] = self._feed(slot, st, max(0.0, w.emitted / w.batch_rows - 1.0), w.rounds)

    def _feed(self, slot: int, st: SlotState, accepted: float, n: int) -> SlotState:
        """``n`` batches of mean ``accepted`` drafts per request, up to the first recompute that changes steps."""
        c, cfg = self.config.slots[slot], self.config
        while n > 0:
            todo = batches_to_recompute(st.batches, cfg.warmup_batches, cfg.update_interval)
            m = min(n, todo)
            ema = st.ema
            if st.steps > 0:  # SGLang does not move the EMA while the slot runs without drafts
                keep = (1.0 - cfg.ema_alpha) ** m
                ema = keep * ema + (1.0 - keep) * accepted
            st = replace(st, ema=ema, batches=st.batches + m)
            n -= m
            if m < todo:
                break
            new = recompute_steps(self._steps[slot], st.steps, st.ema, c.down_hysteresis, c.up_hysteresis)
            if new != st.steps:
                if st.steps == 0 and new > 0 and st.ema < 0:
                    st = replace(st, ema=float(new - 1))  # first probe of a slot that started at 0 steps
                return replace(st, steps=new)  # the window's remaining batches ran at the old steps
        return st

    def _get_state(self) -> dict[str, Any]:
        return {"slots": [[t, d, slot, st.steps, st.ema, st.batches]
                          for (t, d, slot), st in sorted(self._state.items())]}

    def _set_state(self, state: dict[str, Any]) -> None:
        restored: dict[SlotKey, SlotState] = {}
        for t, d, slot, steps, ema, batches in state["slots"]:
            if int(steps) not in self._steps.get(int(slot), ()):
                raise ValueError(f"slot {slot} with steps={steps} is not in this policy's config")
            restored[(str(t), str(d), int(slot))] = SlotState(int(steps), float(ema), int(batches))
        self._state = restored


class SGLangAdaptiveBSPolicy(SGLangAdaptivePolicy):
    """The same controller with the batch-size-aware preset (``PRESETS["bs_aware"]``): same rule, other slots."""

    name = "sglang_adaptive_bs"
    default_config = PRESETS["bs_aware"]
