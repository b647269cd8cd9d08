"""``SpectuneScheduler``: vLLM's v1 scheduler, with each step's k from spectune's table and each step recorded.

Use it with ``--scheduler-cls controller.engines.vllm.scheduler.SpectuneScheduler`` and
``--additional-config '{"spectune": {...}}'`` (the fields of
:class:`~controller.engines.vllm.steps.VllmSpectuneConfig`); ``spectune vllm serve`` passes both. It needs a
speculative config (its ``num_speculative_tokens`` is the largest k) and vLLM's synchronous scheduling (the CPU
backend's only mode; on CUDA pass ``--no-async-scheduling``), where every ``schedule()`` is followed by the
``update_from_output()`` of the same step.

Per step it

1. lets vLLM schedule as usual;
2. reads each scheduled request's type (``SamplingParams.extra_args["request_type"]``, the OpenAI API's
   ``vllm_xargs``; ``*`` when absent) and context length, asks the policy client for each row's k, and sets the
   step's ``num_spec_tokens_to_schedule`` by the batch rule of :mod:`controller.engines.vllm.steps`;
3. after the forward, turns what vLLM reports (drafts verified and tokens sampled per request, and the draft's
   proposal seconds, :mod:`controller.engines.vllm.draft_timing`) into a :class:`~telemetry.records.RoundRecord`
   for the emitter.

vLLM keeps its batch-size table as a plain list, ``dynamic_sd_lookup``. When the deployment gave none, this
scheduler installs one holding the fail-static k: with a table vLLM schedules each decode row with the step's own
k rather than padding every row to ``num_speculative_tokens``; the k actually drafted is the one set in step 2.

Greedy output does not depend on k: a draft token is kept only when it equals the target's own argmax, so any
sequence of k (0 included) yields the target's greedy continuation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

from controller.engines.vllm.draft_timing import propose_seconds
from controller.engines.vllm.steps import (
    ADDITIONAL_CONFIG_KEY,
    RowAtSchedule,
    RowOutcome,
    VllmSpectuneConfig,
    VllmStepBridge,
)

logger = init_logger(__name__)
_TYPE_ATTR = "_spectune_request_type"  # the request's type, validated once, kept on vLLM's Request


def _log_status(st: dict[str, Any]) -> None:
    logger.info("spectune: %d rounds, steps by k %s, %s, overhead %.2f%% of step time", st["rounds"],
                st["k_counts"], st["policy"]["detail"], 100 * st["overhead_share"])


@dataclass
class _Pending:
    """One scheduled step, waiting for its output."""

    output: Any  # the SchedulerOutput handed to the worker
    rows: dict[str, RowAtSchedule]
    requests: dict[str, Any]  # req_id -> Request: finished requests leave self.requests during the update
    prefill_tokens: int
    t_start: float  # perf_counter when schedule() was entered
    t_scheduled: float  # when vLLM's schedule() returned
    t_handed: float  # when this scheduler returned the output (the worker starts)
    gap_s: float  # the engine loop's time between the previous step's update and this schedule() (-1: after idle)
    k_next: int  # drafts proposed in this step's forward for the next one


def _trace_line(p: _Pending, rows: list[tuple[RowAtSchedule, RowOutcome | None]], round_: Any, t3: float,
                t4: float, waiting: int, running: int, propose_s: float | None) -> dict[str, Any]:
    """One step of the trace (``VllmSpectuneConfig.trace_path``): times in seconds, ``gap_s`` < 0 after idle."""
    decoding = [(at, res) for at, res in rows if at.decoding]
    return {
        "t": round(p.t_start, 6), "gap_s": round(p.gap_s, 6), "schedule_s": round(p.t_scheduled - p.t_start, 6),
        "spectune_s": round(p.t_handed - p.t_scheduled, 6), "model_s": round(t3 - p.t_handed, 6),
        "update_s": round(t4 - t3, 6), "propose_s": None if propose_s is None else round(propose_s, 6),
        "draft_s": round(round_.draft_s, 6) if round_ is not None else None,
        "decode_rows": len(decoding), "prefill_rows": len(rows) - len(decoding),
        "prefill_tokens": p.prefill_tokens, "k_next": p.k_next,
        "drafts": sum(res.drafts for _, res in decoding if res is not None),
        "sampled": sum(res.sampled for _, res in decoding if res is not None),
        "emitted": sum(r.emitted for r in round_.rows) if round_ is not None else 0,
        "first_tokens": sum(1 for at, res in rows if not at.decoding and res is not None and res.sampled > 0),
        "prefill_s": round(round_.prefill_s, 6) if round_ is not None else None,
        "waiting": waiting, "running": running,
    }


class SpectuneScheduler(Scheduler):  # type: ignore[misc]  # vLLM is untyped to mypy here
    """vLLM's scheduler with spectune's per-step k and telemetry (see the module docstring)."""

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        raw = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            raise ValueError(f"SpectuneScheduler needs --additional-config '{{\"{ADDITIONAL_CONFIG_KEY}\": {{...}}}}' "
                             "(target_version, draft_version, redis_url, ...); `spectune vllm serve` writes it")
        if self.num_spec_tokens <= 0:
            raise ValueError("SpectuneScheduler needs speculative decoding: pass --speculative-config with "
                             "num_speculative_tokens >= 1 (the largest k spectune may choose)")
        cfg = VllmSpectuneConfig.from_mapping(raw, k_max=self.num_spec_tokens)
        self._bridge = VllmStepBridge(cfg, report=_log_status)
        if self.dynamic_sd_lookup is None:  # type: ignore[has-type]
            self.dynamic_sd_lookup = [cfg.start_k] * (self.scheduler_config.max_num_seqs + 1)
        self._pending: _Pending | None = None
        self._last_end: float | None = None  # perf_counter at the end of the previous step's update
        logger.info("spectune: engine %s follows the policy for %s + %s (k <= %d, %s); windows -> %s",
                    cfg.engine_id, cfg.target_version, cfg.draft_version, cfg.k_max,
                    f"fixed k={cfg.fixed_k}" if cfg.fixed_k is not None else f"fail-static k={cfg.start_k}",
                    "Redis" if cfg.redis_url else "nowhere (no redis_url)")

    @property
    def spectune(self) -> VllmStepBridge:
        return self._bridge

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = super().schedule(*args, **kwargs)
        t1 = time.perf_counter()
        bridge = self._bridge
        scheduled = out.num_scheduled_tokens
        if not scheduled:
            self._pending = None
            self._last_end = None  # idle: the next step's gap is waiting for work, not the loop's cost
            return out
        try:
            rows, held, prefill = self._snapshot(scheduled)
            k_next = bridge.choose_k(list(rows.values()), len(scheduled))
            out.num_spec_tokens_to_schedule = k_next
        except Exception as e:  # spectune's own fault must never stop vLLM: fail static, count, carry on
            bridge.step_failed("schedule", e)
            out.num_spec_tokens_to_schedule = bridge.config.start_k
            self._pending = None
            return out
        t2 = time.perf_counter()
        bridge.counters.added_s += t2 - t1
        gap = t0 - self._last_end if self._last_end is not None else -1.0
        self._pending = _Pending(out, rows, held, prefill, t0, t1, t2, gap, k_next)
        return out

    def _snapshot(self, scheduled: dict[str, int]) -> tuple[dict[str, RowAtSchedule], dict[str, Any], int]:
        """Each scheduled request as spectune sees it (type, context, decoding or prompt chunk), and the step's
        prompt tokens."""
        rows: dict[str, RowAtSchedule] = {}
        held: dict[str, Any] = {}
        prefill = 0
        type_of = self._bridge.request_type
        for req_id, n in scheduled.items():
            req = self.requests.get(req_id)
            if req is None:
                continue
            ctx = req.num_tokens
            decoding = req.num_computed_tokens - n >= ctx - 1  # only the last sampled token was uncomputed
            if not decoding:
                prefill += n
            rtype = getattr(req, _TYPE_ATTR, None)
            if rtype is None:  # read (and counted, when bad) once per request, kept on the request
                sp = req.sampling_params
                rtype = type_of(sp.extra_args if sp is not None else None)
                setattr(req, _TYPE_ATTR, rtype)
            rows[req_id] = RowAtSchedule(rtype, ctx, decoding, req.num_output_tokens)
            held[req_id] = req
        return rows, held, prefill

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        t3 = time.perf_counter()
        pending, self._pending = self._pending, None
        if pending is None or pending.output is not scheduler_output:
            self._last_end = None  # a step spectune did not follow: the next gap is not measured
            return super().update_from_output(scheduler_output, model_runner_output)
        result = super().update_from_output(scheduler_output, model_runner_output)
        t4 = time.perf_counter()
        bridge = self._bridge
        try:
            sampled = model_runner_output.sampled_token_ids
            index = model_runner_output.req_id_to_index
            spec = scheduler_output.scheduled_spec_decode_tokens
            rows: list[tuple[RowAtSchedule, RowOutcome | None]] = []
            for req_id, at in pending.rows.items():
                i = index.get(req_id)
                n_sampled = len(sampled[i]) if sampled and i is not None else 0
                outcome = None if n_sampled == 0 else RowOutcome(
                    len(spec.get(req_id, ())), n_sampled, pending.requests[req_id].num_output_tokens)
                rows.append((at, outcome))
            propose_s = propose_seconds(model_runner_output)
            round_ = bridge.round_record(
                rows, schedule_s=pending.t_scheduled - pending.t_start, model_s=t3 - pending.t_handed,
                update_s=t4 - t3, prefill_tokens=pending.prefill_tokens,
                total_tokens=scheduler_output.total_num_scheduled_tokens, timestamp=time.time(), propose_s=propose_s)
            if round_ is not None:
                bridge.record(round_)
            if bridge.config.trace_path is not None:
                bridge.trace(_trace_line(pending, rows, round_, t3, t4, len(self.waiting), len(self.running),
                                         propose_s))
        except Exception as e:  # a record spectune cannot build is lost and counted; vLLM's step is not
            bridge.step_failed("record", e)
        self._last_end = time.perf_counter()
        bridge.counters.added_s += self._last_end - t4
        return result

    def shutdown(self) -> None:
        try:
            self._bridge.close()
        finally:
            super().shutdown()
