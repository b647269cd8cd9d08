"""What spectune does in each vLLM step, without vLLM: pick the step's k from the table, record the step.

vLLM (0.32 on) drafts one k for the whole batch each step (``SchedulerOutput.num_spec_tokens_to_schedule``; the
drafter proposes that many tokens for every running request, verified in the next step). spectune's table holds
a k per row bucket (request type, batch size, context length), so the batch's k is derived from its rows:

**The batch rule.** Every row of the step asks the table for its k, for its own request type but at the
*step's* batch size and the *step's* context: the longest context among the scheduled rows. The batch runs the
**lower median** of those answers. At least half of the rows asked for this k or more and at least half for this
k or less, so no minority type steers the batch; between two middle values the smaller wins, because a larger k
costs every row's verification while only some rows gain from it. In a batch of one type this is that type's k;
in a mixed batch it is the dominant type's k whenever that type holds more than half of the rows.

Why the step's context and not each row's own: a round's cost is learnt in the cell of its longest context
(:mod:`telemetry.aggregate`), so that is the cell whose k the round measures. Asked per row, a batch of sixteen
with one long prompt ran the k of the short rows' cell (<=512) while every one of its rounds was costed in the
long cell (<=2048): the cell that chose k was never measured at the k it chose, and the cell that was measured
never chose. On ``bench vllm`` that left batch 16 at k = 0 for 889 rounds (279 tok/s by the engine's own
windows) beside 353 tok/s measured at k = 3 in the same cell.

**A step as a round.** One vLLM step verifies the drafts proposed in the previous step and proposes the next
ones. Each decoding row becomes a :class:`~telemetry.records.RowRecord`: ``k`` = drafts verified for it this
step, ``accepted`` = sampled tokens - 1, ``emitted`` = tokens actually appended (fewer when it stopped
mid-draft). Rows still prefilling are not rows of the round. Times, from the scheduler's side of the step:

- ``verify_s``: from the end of ``schedule()`` to the start of ``update_from_output()`` is the worker's whole
  call, which in vLLM is the target's verification *and* the draft's proposal for the next step. The worker times
  the proposal (:mod:`controller.engines.vllm.draft_timing`) and sends its seconds with the step's output, so
  ``verify_s`` is the call less this step's proposal (and less the prompt's part, below);
- ``draft_s``: the proposal of the step *before*, which made the drafts this round verifies. Charged to the step
  that ran it, a proposal of k = 5 after a verification of k = 3 would be timed as a k = 3 round, so under a policy
  that changes k every few steps each k would pay its neighbours' drafting and deep k would look cheap. Without
  the timer (another vLLM) ``draft_s`` is 0 and ``verify_s`` the whole call, as before;
- ``prefill_s``: the part of that forward spent on prompt tokens. It is the *marginal* prompt cost: the slope
  of seconds over prompt tokens, learned online by :class:`PrefillCost` (from prefill-only steps or, under
  constant load, from mixed steps' excess over decode-only ones), times this step's prompt tokens, capped at
  the prompt tokens' share of the step's tokens. Until a slope is known, the step is split by token count.
  Why not the token split alone: a prompt of 1,400 tokens beside four decoding rows would take 99% of the step,
  so the decoding rows' tokens would look almost free, and more free tokens at a larger k make a larger k look
  better than it is. The step's fixed cost (the target's weights read once, the drafter's k sequential passes)
  belongs to the decoding rows, which pay it with or without the prompt;
- ``other_s``: the scheduler's own work, ``schedule()`` plus ``update_from_output()``.

**Only decode-only steps teach cost** (``RoundRecord.costed``; ``cost_mixed_steps`` restores the old way). The
prompt's part of a mixed step is an estimate, and a poor one: in a trace of ``bench vllm``'s c4-c32 load (2-core
Zen 3 VM, the twenty-second session) the steps with prompt tokens came out, after the split, at 0.2-1.9x the
decode-only steps of the same rows bucket and k: too cheap beside a few hundred prompt tokens ((16 rows, k = 0):
24.6 ms over 38 mixed steps against 41.2 ms over 890 decode-only; (4, 5): 34.6 against 59.2), too dear beside a
2,000-token one ((4, 1): 73.9 against 39.2). Mixed steps come in bursts (a phase's new prompts), so they land on
whichever k ran then, an incumbent or one exploration whose few windows they dominate. Their rows still count for
acceptance; their seconds and per-token latencies leave the cost windows (no policy reads those latencies; the
bench's client measures TPOT). Most steps are decode-only (95% of the steps with 9-32 decoding rows there).

Nothing here imports vLLM or torch; :mod:`controller.engines.vllm.scheduler` feeds it plain values.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from controller.client import ClientConfig, EngineHooks, PolicyClient, build_engine_hooks
from telemetry.emitter import EmitterConfig
from telemetry.records import MAX_DRAFT_LEN, WILDCARD, RecordError, RoundRecord, RowRecord
from telemetry.transport import DEFAULT_PREFIX
from telemetry.wire import check_label

ADDITIONAL_CONFIG_KEY = "spectune"  # vLLM's --additional-config {"spectune": {...}} carries VllmSpectuneConfig
TYPE_ARG = "request_type"  # SamplingParams.extra_args key; the OpenAI API sends it as "vllm_xargs"
MAX_REQUEST_TYPES = 64  # distinct request types one engine reports; clients choose them, so past this they fold
STATUS_EVERY_S = 5.0  # seconds between status lines
TRACE_FLUSH_STEPS = 256  # a step trace is written in blocks of this many lines, with each status line and at close


@dataclass(frozen=True)
class VllmSpectuneConfig:
    """spectune inside one vLLM engine. Passed as ``--additional-config '{"spectune": {...}}'``."""

    target_version: str  # version ids of the served models, as spectune's telemetry and table name them
    draft_version: str
    k_max: int  # vLLM's num_speculative_tokens: the most drafts it has buffers and KV lookahead for
    engine_id: str = "vllm-0"  # unique per engine process (idempotency key of its windows)
    redis_url: str | None = None  # windows out, table in; None: no telemetry, the table only by fixed_k/default_k
    prefix: str = DEFAULT_PREFIX  # must match the sidecar's
    default_k: int | None = None  # fail-static k before a table arrives; None: k_max, vLLM's own static setting
    fixed_k: int | None = None  # follow no table: every step drafts this k (static baselines on the same path)
    window_s: float = 0.25  # emitter window
    refresh_s: float = 1.0  # policy client's timer refresh under the pub/sub nudge
    type_arg: str = TYPE_ARG  # which SamplingParams.extra_args key holds the request type
    max_request_types: int = MAX_REQUEST_TYPES
    status_path: str | None = None  # append a JSON status line here every status_every_s (None: log only)
    status_every_s: float = STATUS_EVERY_S
    # append one JSON line per step here (None: no trace): where a step's wall time went (the engine loop's gap
    # before it, schedule, forward and the draft's proposal in it, update), its rows, prompt tokens, k and tokens;
    # for diagnosis, not for the policy
    trace_path: str | None = None
    # a step that ran prompt tokens beside its decoding rows teaches the cost model too (its prompt part estimated,
    # see the module docstring); False: only decode-only steps do, the others count for acceptance alone
    cost_mixed_steps: bool = False

    def __post_init__(self) -> None:
        for name in ("target_version", "draft_version", "engine_id"):
            try:
                check_label(getattr(self, name), f"spectune.{name}")
            except RecordError as e:
                raise ValueError(e.detail) from None
        if not 1 <= self.k_max <= MAX_DRAFT_LEN:
            raise ValueError(f"spectune.k_max must be in [1, {MAX_DRAFT_LEN}] (vLLM's num_speculative_tokens), "
                             f"got {self.k_max}")
        for name in ("default_k", "fixed_k"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= self.k_max:
                raise ValueError(f"spectune.{name} must be in [0, k_max={self.k_max}], got {v}")
        if self.window_s <= 0 or self.refresh_s <= 0 or self.status_every_s <= 0:
            raise ValueError("spectune.window_s, refresh_s and status_every_s must be > 0")
        if self.max_request_types < 1:
            raise ValueError("spectune.max_request_types must be >= 1")
        if not self.type_arg:
            raise ValueError("spectune.type_arg must name an extra_args key")

    @property
    def start_k(self) -> int:
        return self.k_max if self.default_k is None else self.default_k

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], k_max: int | None = None) -> VllmSpectuneConfig:
        """Build from the ``spectune`` entry of vLLM's additional config; ``k_max`` fills in vLLM's own value.

        Raises:
            ValueError: an unknown key, a missing required one, or a value out of range (the message says which).
        """
        if not isinstance(raw, Mapping):
            raise ValueError(f"--additional-config's {ADDITIONAL_CONFIG_KEY!r} entry must be an object, "
                             f"got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown spectune settings {unknown}; known: {sorted(known)}")
        values = dict(raw)
        if k_max is not None:
            if "k_max" in values and values["k_max"] != k_max:
                raise ValueError(f"spectune.k_max={values['k_max']} disagrees with vLLM's num_speculative_tokens="
                                 f"{k_max}; leave it out")
            values["k_max"] = k_max
        missing = sorted(f.name for f in fields(cls) if f.name not in values and f.name in _REQUIRED)
        if missing:
            raise ValueError(f"spectune settings missing: {missing}")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})


_REQUIRED = ("target_version", "draft_version", "k_max")


def batch_k(row_ks: Sequence[int]) -> int:
    """The batch's k from its rows' k: the lower median (see the module docstring).

    Args:
        row_ks: ``[R]`` the table's k for each decoding row of the step (R >= 1).
    """
    s = sorted(row_ks)
    return s[(len(s) - 1) // 2]


@dataclass(frozen=True)
class RowAtSchedule:
    """A request as the scheduler saw it when it scheduled the step (before the forward)."""

    request_type: str
    context_len: int  # prompt + output tokens before this step's tokens
    decoding: bool  # False: a prompt chunk (prefill, or recomputation after preemption)
    outputs_before: int  # output tokens before this step


@dataclass(frozen=True)
class RowOutcome:
    """What the step did for a decoding request."""

    drafts: int  # draft tokens verified for it this step (its k)
    sampled: int  # tokens the sampler returned for it (accepted + 1), before stop handling
    outputs_after: int  # output tokens after this step (stop strings and max_tokens applied)


@dataclass
class BridgeCounters:
    """What the bridge did, for operators and the overhead figure."""

    steps: int = 0  # steps that scheduled tokens
    rounds: int = 0  # steps recorded as rounds (with at least one decoding row)
    uncosted_rounds: int = 0  # ... of which ran prompt tokens too: acceptance only (see cost_mixed_steps)
    k_set: int = 0  # steps whose k came from the table or fixed_k
    rows_skipped: int = 0  # decoding rows without sampled tokens (aborted mid-step)
    added_s: float = 0.0  # seconds spent in spectune's code inside schedule() and update_from_output()
    step_s: float = 0.0  # seconds of whole steps (schedule start to update end)
    model_s: float = 0.0  # seconds of the worker's forwards
    draft_timed_steps: int = 0  # steps whose output carried the draft's proposal seconds (draft_timing)
    propose_s: float = 0.0  # seconds of those proposals (a part of model_s)
    bad_request_types: int = 0  # request types refused by the label rule (reported as "*")
    folded_request_types: int = 0  # rows whose new type came past max_request_types (reported as "*")
    last_bad_request_type: str | None = None
    last_status_error: str | None = None
    step_errors: int = 0  # steps where spectune's own code failed (vLLM carried on at the fail-static k)
    trace_errors: int = 0  # trace blocks that could not be written (the lines are dropped, the steps are not)
    last_step_error: str | None = None
    k_counts: dict[int, int] | None = None  # steps per chosen k


class _LineFit:
    """y = a + b x by least squares with exponential forgetting (``decay`` of the past kept per sample)."""

    def __init__(self, decay: float, min_samples: int) -> None:
        self.decay = decay
        self.min_samples = min_samples
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.samples += 1

    def slope(self) -> float | None:
        """b, or None before ``min_samples`` samples, when the x's barely differ, or when b <= 0."""
        if self.samples < self.min_samples:
            return None
        w = self._w
        mean_x = self._x / w
        var_x = self._xx / w - mean_x * mean_x
        if var_x <= (0.05 * mean_x) ** 2:  # (nearly) one x: no slope to fit
            return None
        b = (self._xy / w - mean_x * self._y / w) / var_x
        return b if b > 0.0 else None


class PrefillCost:
    """What one more prompt token adds to a vLLM step's forward, learned online from the steps themselves.

    Two estimates of the same slope (seconds per prompt token), the first preferred:

    - **prefill-only steps**: seconds = fixed + slope x prompt tokens, fitted over steps without decoding rows;
    - **mixed steps**, for engines that never run a prefill-only step (constant load): the step's seconds above
      the decode-only steps of the same (decoding rows, k), fitted against its prompt tokens. The decode-only
      baseline is a moving average per (rows, k).

    Only the slope is used: in a mixed step the fixed part belongs to the decoding rows, which pay it anyway.

    Args:
        decay: weight kept by the past per new sample (0.99: about the last 100 samples).
        min_samples: samples before a slope is trusted.
        baseline_alpha: weight of a new decode-only step in its (rows, k) average.
    """

    def __init__(self, decay: float = 0.99, min_samples: int = 8, baseline_alpha: float = 0.1) -> None:
        if not 0.0 < decay <= 1.0 or min_samples < 2 or not 0.0 < baseline_alpha <= 1.0:
            raise ValueError("PrefillCost needs 0 < decay <= 1, min_samples >= 2 and 0 < baseline_alpha <= 1")
        self.prefill_only = _LineFit(decay, min_samples)
        self.mixed = _LineFit(decay, min_samples)
        self.baseline_alpha = baseline_alpha
        self._decode_s: dict[tuple[int, int], float] = {}  # (decoding rows, k) -> seconds of a decode-only step

    def add(self, tokens: int, seconds: float) -> None:
        """A prefill-only step: ``tokens`` prompt tokens in ``seconds`` of forward."""
        if tokens > 0 and seconds > 0.0:
            self.prefill_only.add(float(tokens), seconds)

    def add_step(self, rows: int, k: int, tokens: int, seconds: float) -> None:
        """A step with ``rows`` decoding rows at ``k`` (and ``tokens`` prompt tokens, 0 for a decode-only step)."""
        if not seconds > 0.0 or rows <= 0:
            return
        key = (rows, k)
        base = self._decode_s.get(key)
        if tokens <= 0:
            a = self.baseline_alpha
            self._decode_s[key] = seconds if base is None else base + a * (seconds - base)
        elif base is not None:
            self.mixed.add(float(tokens), seconds - base)

    def per_token(self) -> float | None:
        """Seconds per extra prompt token (None until either fit has a slope)."""
        b = self.prefill_only.slope()
        return b if b is not None else self.mixed.slope()

    def split(self, model_s: float, prefill_tokens: int, total_tokens: int) -> float:
        """The prompt part of a step's ``model_s``: slope x prompt tokens, at most the prompt's token share (the
        token share itself while no slope is known)."""
        if prefill_tokens <= 0 or total_tokens <= 0:
            return 0.0
        share = model_s * min(1.0, prefill_tokens / total_tokens)
        slope = self.per_token()
        return share if slope is None else min(share, slope * prefill_tokens)


class VllmStepBridge:
    """The per-step logic of :class:`~controller.engines.vllm.scheduler.SpectuneScheduler`, without vLLM.

    Args:
        config: the engine's settings.
        hooks: the policy client and emitter (None: built from ``config.redis_url``; a table-less client when
            that is None too).
    """

    def __init__(self, config: VllmSpectuneConfig, hooks: EngineHooks | None = None,
                 report: Callable[[dict[str, Any]], None] | None = None, start: bool = True) -> None:
        self.config = config
        client_cfg = ClientConfig(target_version=config.target_version, draft_version=config.draft_version,
                                  default_k=config.start_k, k_max=config.k_max, redis_url=config.redis_url,
                                  prefix=config.prefix, refresh_s=config.refresh_s)
        if hooks is None and config.redis_url is not None:  # a fixed_k baseline reports its rounds too
            hooks = build_engine_hooks(client_cfg, EmitterConfig(engine_id=config.engine_id,
                                                                 interval_s=config.window_s))
        self.hooks = hooks
        self.client: PolicyClient = hooks.client if hooks is not None else PolicyClient(client_cfg, start=False)
        self._decide = self.client.decide
        self._types: set[str] = set()
        self.counters = BridgeCounters(k_counts={})
        self.prefill_cost = PrefillCost()
        self._round_index = 0
        self._last_propose_s: float | None = None  # the previous step's draft proposal (made this step's drafts)
        self._report = report
        self._stop = threading.Event()
        self._trace: list[str] = []
        self._trace_lock = threading.Lock()  # close() flushes from another thread than the steps'
        self._thread: threading.Thread | None = None
        if start and (config.status_path or report is not None):  # reports while idle too, off the step path
            self._thread = threading.Thread(target=self._status_loop, name="spectune-vllm-status", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------------------------ request type
    def request_type(self, extra_args: Mapping[str, Any] | None) -> str:
        """The request's type from its extra args: ``*`` when absent, refused by the label rule, or new past the
        cap (each counted)."""
        if not extra_args:
            return WILDCARD
        raw = extra_args.get(self.config.type_arg)
        if raw is None:
            return WILDCARD
        if type(raw) is str and raw in self._types:  # vllm_xargs values may be lists or numbers: never hash them
            return raw
        try:
            name = check_label(raw, "request type")
        except RecordError:
            self.counters.bad_request_types += 1
            self.counters.last_bad_request_type = repr(raw)[:80]
            return WILDCARD
        if len(self._types) >= self.config.max_request_types:
            self.counters.folded_request_types += 1
            return WILDCARD
        self._types.add(name)
        return name

    # ------------------------------------------------------------------------------------------ decide
    def choose_k(self, rows: Sequence[RowAtSchedule], batch_size: int) -> int:
        """The k the batch drafts next: ``fixed_k``, or the batch rule over the rows' table answers.

        Args:
            rows: the scheduled requests (prefilling ones included: they draft after their last chunk).
            batch_size: the requests scheduled this step (what vLLM's own batch-size table is indexed by).
        """
        cfg = self.config
        if cfg.fixed_k is not None:
            k = cfg.fixed_k
        elif not rows:
            k = cfg.start_k
        else:
            decide = self._decide
            ctx = max(r.context_len for r in rows)  # the cell the verifying round is costed in (module docstring)
            k = batch_k([decide(r.request_type, batch_size, ctx) for r in rows])
        k = min(k, cfg.k_max)
        counts = self.counters.k_counts
        assert counts is not None
        counts[k] = counts.get(k, 0) + 1
        self.counters.k_set += 1
        return k

    # ------------------------------------------------------------------------------------------ record
    def round_record(self, rows: Sequence[tuple[RowAtSchedule, RowOutcome | None]], *, schedule_s: float,
                     model_s: float, update_s: float, prefill_tokens: int, total_tokens: int,
                     timestamp: float, propose_s: float | None = None) -> RoundRecord | None:
        """The step as a round (None when no row was decoding: a prefill-only step).

        Args:
            rows: each scheduled request with its outcome (None when it sampled nothing).
            schedule_s, model_s, update_s: the step's parts, in seconds (see the module docstring).
            prefill_tokens, total_tokens: prompt tokens and all tokens the step scheduled.
            propose_s: the part of ``model_s`` the drafter spent proposing the next step's drafts
                (:mod:`controller.engines.vllm.draft_timing`); None when not measured.
        """
        c = self.counters
        c.steps += 1
        c.model_s += model_s
        c.step_s += schedule_s + model_s + update_s
        # The drafts verified now were proposed in the step before: that proposal is this round's draft time, and
        # this step's own proposal (for the next round) leaves its verification time (module docstring).
        made_drafts, self._last_propose_s = self._last_propose_s, propose_s
        if propose_s is not None:
            c.draft_timed_steps += 1
            c.propose_s += propose_s
            model_s = max(0.0, model_s - propose_s)
        draft_s = made_drafts if made_drafts is not None and propose_s is not None else 0.0
        out: list[RowRecord] = []
        for at, res in rows:
            if not at.decoding:
                continue
            if res is None or res.sampled <= 0:
                c.rows_skipped += 1
                continue
            k = res.drafts
            accepted = min(res.sampled - 1, k)
            emitted = max(0, min(res.outputs_after - at.outputs_before, accepted + 1))
            out.append(RowRecord(at.request_type, at.context_len, k, accepted, emitted))
        if not out:
            if prefill_tokens > 0 and prefill_tokens == total_tokens:
                self.prefill_cost.add(prefill_tokens, model_s)
            return None
        max_k = max(r.k for r in out)
        self.prefill_cost.add_step(len(out), max_k, prefill_tokens, model_s)
        prefill_s = self.prefill_cost.split(model_s, prefill_tokens, total_tokens)
        self._round_index += 1
        c.rounds += 1
        costed = prefill_tokens <= 0 or self.config.cost_mixed_steps
        c.uncosted_rounds += not costed
        return RoundRecord(
            round_index=self._round_index, batch_size=len(out), max_k=max_k,
            tokens_verified=sum(r.k + 1 for r in out), draft_s=draft_s, verify_s=model_s - prefill_s,
            other_s=schedule_s + update_s, prefill_s=prefill_s,
            target_version=self.config.target_version, draft_version=self.config.draft_version,
            rows=tuple(out), timestamp=timestamp, costed=costed,
        )

    def step_failed(self, where: str, error: BaseException) -> None:
        """spectune's code failed inside a vLLM step: counted and kept for the status lines, never raised."""
        self.counters.step_errors += 1
        self.counters.last_step_error = f"{where}: {type(error).__name__}: {error}"[:300]

    def record(self, round_: RoundRecord) -> None:
        if self.hooks is not None:
            self.hooks.record(round_)

    def trace(self, step: Mapping[str, Any]) -> None:
        """One step's line for ``trace_path`` (nothing without one), written in blocks of ``TRACE_FLUSH_STEPS``."""
        if self.config.trace_path is None:
            return
        line = json.dumps(step, separators=(",", ":"))
        with self._trace_lock:
            self._trace.append(line)
            if len(self._trace) >= TRACE_FLUSH_STEPS:
                self._flush_trace()

    def _flush_trace(self) -> None:
        lines, self._trace = self._trace, []
        if not lines or self.config.trace_path is None:
            return
        try:
            with Path(self.config.trace_path).open("a") as f:
                f.write("\n".join(lines) + "\n")
        except OSError as e:  # a full disk must not stop the engine: counted, shown in the status
            self.counters.trace_errors += 1
            self.counters.last_step_error = f"trace: {type(e).__name__}: {e}"[:300]

    # ------------------------------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """Counters, the policy client's state and the overhead share, JSON-safe."""
        c = self.counters
        st = self.client.status()
        em = self.hooks.emitter.stats() if self.hooks is not None and self.hooks.emitter is not None else None
        return {
            "t": time.time(), "engine_id": self.config.engine_id, "steps": c.steps, "rounds": c.rounds,
            "uncosted_rounds": c.uncosted_rounds,
            "k_counts": {str(k): n for k, n in sorted(dict(c.k_counts or {}).items())},  # copied: steps add keys
            "added_s": c.added_s, "step_s": c.step_s, "model_s": c.model_s, "propose_s": c.propose_s,
            "draft_timed_steps": c.draft_timed_steps,
            "overhead_share": c.added_s / c.step_s if c.step_s > 0 else 0.0,
            "prefill_only_steps": self.prefill_cost.prefill_only.samples,
            "mixed_steps_fitted": self.prefill_cost.mixed.samples, "prefill_s_per_token": self.prefill_cost.per_token(),
            "rows_skipped": c.rows_skipped, "bad_request_types": c.bad_request_types,
            "folded_request_types": c.folded_request_types, "last_bad_request_type": c.last_bad_request_type,
            "request_types": sorted(set(self._types)), "last_status_error": c.last_status_error,
            "step_errors": c.step_errors, "last_step_error": c.last_step_error, "trace_errors": c.trace_errors,
            "policy": {"mode": st.mode, "version": st.version, "fail_static": st.fail_static,
                       "rejected": st.rejected, "detail": st.detail, "last_error": st.last_error},
            "emitter": None if em is None else {"rounds_recorded": em.rounds_recorded,
                                                "rounds_rejected": em.rounds_rejected,
                                                "windows_sent": em.windows_sent,
                                                "windows_dropped": em.windows_dropped,
                                                "last_error": em.last_error},
        }

    def _status_loop(self) -> None:
        reported = -1
        while not self._stop.wait(self.config.status_every_s):
            try:
                with self._trace_lock:  # a slow engine's trace reaches the file at least this often
                    self._flush_trace()
                st = self.write_status()
                if self._report is not None and st["steps"] != reported:  # an idle engine logs nothing new
                    reported = st["steps"]
                    self._report(st)
            except Exception as e:  # a full disk or a logging failure must not stop the engine
                self.counters.last_status_error = f"{type(e).__name__}: {e}"

    def write_status(self, final: bool = False) -> dict[str, Any]:
        """Append a status line to ``status_path`` (when set); returns the status."""
        st = self.status() | ({"final": True} if final else {})
        if self.config.status_path:
            with Path(self.config.status_path).open("a") as f:
                f.write(json.dumps(st) + "\n")
        return st

    def close(self) -> None:
        """Flush telemetry, stop following the table, write a final status line."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._trace_lock:
            self._flush_trace()
        if self.hooks is not None:
            self.hooks.close()
        else:
            self.client.close()
        self.write_status(final=True)
