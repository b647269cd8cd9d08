"""Lazy draft KV sync: at k = 0 vLLM's draft model does no work; its KV cache catches up when drafting resumes.

**What vLLM does.** With ``method: draft_model`` and a k chosen per step (``num_spec_tokens_to_schedule``), vLLM
0.32 runs the draft's first pass over every token the target computes, also in a step that drafts nothing (k = 0),
"to keep the drafter KV cache in sync" (``SpecDecodeBaseProposer.propose``). So a server that may ever speculate
pays for the draft at every step it does not: on ``bench vllm`` (xl + draft-v1, 2-core VM) a draft-loaded server
at k = 0 ran 0.80-0.97x a server without a draft, by phase, and "speculation off" was never off. Upstream knows
the cost (vLLM issue #49548; vllm-metal's lazy catch-up, PR #734; an opt-in skip in vLLM PR #53426).

**What this does** (``SPECTUNE_DRAFT_SYNC=lazy`` in vLLM's environment; the launcher installs it in every vLLM
process). The draft model proposer, in a step with k = 0, records for each scheduled request the first position
whose draft KV it did not write, and returns no drafts without running the draft. In the next step with k > 0, it
first runs the draft over each such request's missing positions (its own tokens, at their own positions, into its
own KV slots: a chunked prefill of the draft), then proposes as vLLM does. A request that finishes while k = 0
never costs the draft anything. The draft's cache is then what eager sync leaves, so acceptance does not change
(the test compares the two, token for token, over an on/off k schedule); the target's output never depends on the
draft, since every draft token is verified. And the engine process, after a k = 0 step, does not fetch the (empty)
drafts from the worker: one inter-process round trip less per step.

A step that has no drafts to verify and makes none (k = 0 now and at the step before) runs as a runner without a
speculative config would: vLLM otherwise takes its speculative path in every step of a draft-loaded server
(spec-decode metadata, the rejection sampler over zero drafts, the drafter's input preparation, the copy of its empty
output), about 0.5 ms a step on the 2-core VM. The test checks this path is taken in exactly those steps and that
tokens and acceptance stay those of vLLM's own sync.

Under async scheduling (CUDA's default, not spectune's scheduler, which needs ``--no-async-scheduling``) a step's
computed-token counts are optimistic when the drafter runs, so there the proposer keeps vLLM's own sync.

Prefix caching: a request that joins with cached blocks may find them written by a request whose draft pass was
skipped, so after the first skip a request first seen past position 0 catches up from position 0.

The other proposers (EAGLE, MTP, n-gram) are left alone: EAGLE-family drafters read the target's hidden states,
which are gone by the time drafting resumes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

MODE_ENV = "SPECTUNE_DRAFT_SYNC"
MODES = ("eager", "lazy")  # eager: vLLM's own (the draft runs at k = 0); lazy: this module
_PATCHED = "_spectune_lazy_draft_sync"


def mode_from_env(env: Any = None) -> str:
    """The mode ``SPECTUNE_DRAFT_SYNC`` asks for; a value outside :data:`MODES` is refused."""
    raw = (os.environ if env is None else env).get(MODE_ENV, "eager").strip().lower() or "eager"
    if raw not in MODES:
        raise ValueError(f"{MODE_ENV}={raw!r}: expected one of {', '.join(MODES)}")
    return raw


@dataclass
class SyncState:
    """What one draft proposer knows about its KV cache, per request. No vLLM types: tested alone."""

    stale_from: dict[str, int] = field(default_factory=dict)  # request -> first position the draft did not write
    seen: set[str] = field(default_factory=set)  # requests this proposer has met
    dirty: bool = False  # a step was skipped since start: cached prefix blocks may lack draft KV
    skipped_steps: int = 0
    plain_steps: int = 0  # skipped steps that also ran vLLM's plain (non-speculative) path: nothing to verify
    skipped_tokens: int = 0  # target tokens whose draft pass was deferred
    caught_up_tokens: int = 0  # deferred tokens the draft later ran

    def forget_finished(self, live: Any) -> None:
        """Drop requests that left the engine (``live`` answers ``in``)."""
        for r in [r for r in self.stale_from if r not in live]:
            del self.stale_from[r]
        self.seen = {r for r in self.seen if r in live}

    def skip(self, rows: list[tuple[str, int, int]]) -> None:
        """A k = 0 step whose draft pass is skipped. ``rows``: (request, first position of its tokens this step,
        tokens this step)."""
        self.dirty = True
        self.skipped_steps += 1
        for req, start, n in rows:
            self.seen.add(req)
            self.stale_from[req] = min(self.stale_from.get(req, start), start)
            self.skipped_tokens += n

    def catch_up(self, rows: list[tuple[str, int, int]]) -> list[tuple[int, int, int]]:
        """A step with k > 0: the (row index, first, end) position ranges the draft must run before proposing.
        Marks them caught up."""
        out: list[tuple[int, int, int]] = []
        for i, (req, start, _n) in enumerate(rows):
            first_time = req not in self.seen
            self.seen.add(req)
            m = self.stale_from.pop(req, 0 if (first_time and self.dirty) else start)
            if m < start:
                out.append((i, m, start))
                self.caught_up_tokens += start - m
        return out


def plain_step(scheduler_output: Any) -> bool:
    """A step that verifies no drafts and proposes none: it can run vLLM's plain path."""
    if getattr(scheduler_output, "num_spec_tokens_to_schedule", None) != 0:
        return False
    return not any(scheduler_output.scheduled_spec_decode_tokens.values())


def pack(ranges: list[tuple[int, int, int]], budget: int) -> list[list[tuple[int, int, int]]]:
    """Split (row, first, end) ranges into forwards of at most ``budget`` tokens, each row at most once per
    forward and its pieces in position order."""
    if budget < 1:
        raise ValueError("budget must be >= 1")
    out: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    used = 0
    for row, a, b in ranges:
        while a < b:
            if used == budget:
                out.append(cur)
                cur, used = [], 0
            take = min(b - a, budget - used)
            cur.append((row, a, a + take))
            used += take
            a += take
            if a < b:  # the rest of this row goes in the next forward
                out.append(cur)
                cur, used = [], 0
    if cur:
        out.append(cur)
    return out


def _catch_up_forward(proposer: Any, cad: Any, token_ids: Any, segs: list[tuple[int, int, int]]) -> None:
    """Run the draft over ``segs`` (row, first, end) of the running batch, writing its KV for those positions."""
    import numpy as np
    import torch
    from vllm.forward_context import set_forward_context

    dev = proposer.device
    lens = [b - a for _, a, b in segs]
    total = sum(lens)
    ids = np.concatenate([token_ids[row, a:b] for row, a, b in segs])  # [total]
    pos = np.concatenate([np.arange(a, b) for _, a, b in segs])  # [total]
    rows = torch.tensor([row for row, _, _ in segs], dtype=torch.long, device=dev)  # [n]
    qsl_cpu = torch.zeros(len(segs) + 1, dtype=torch.int32)  # [n + 1]
    qsl_cpu[1:] = torch.tensor(np.cumsum(lens), dtype=torch.int32)
    seq_lens = torch.tensor([b for _, _, b in segs], dtype=torch.int32, device=dev)  # [n]
    block_table = cad.block_table_tensor[rows]  # [n, max_blocks]
    pos_t = torch.from_numpy(pos.astype(np.int64)).to(dev)  # [total]
    seg_of = torch.repeat_interleave(torch.arange(len(segs), device=dev), torch.tensor(lens, device=dev))
    bs = proposer.block_size
    slot = block_table[seg_of, pos_t // bs].to(torch.int64) * bs + pos_t % bs  # [total]
    sub = cad.replace(
        query_start_loc=qsl_cpu.to(dev), query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens, num_reqs=len(segs),
        num_actual_tokens=total, max_query_len=max(lens), max_seq_len=max(b for _, _, b in segs),
        block_table_tensor=block_table, slot_mapping=slot, positions=None, is_prefilling=None,
        seq_lens_cpu_upper_bound=seq_lens.cpu(), req_idx=None, dcp_local_seq_lens=None,
        dcp_local_seq_lens_cpu_upper_bound=None, logits_indices_padded=None, num_logits_indices=None,
        max_logits_per_req=None, _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)
    proposer.input_ids[:total] = torch.from_numpy(ids.astype(np.int64)).to(dev)
    proposer._set_positions(total, pos_t)
    _, per_layer = proposer.build_per_group_and_layer_attn_metadata(sub)
    mode, num_input_tokens, across_dp = proposer._determine_batch_execution_and_padding(total)
    model_kwargs, slot_size = proposer.build_model_inputs_first_pass(total, num_input_tokens, None)
    with set_forward_context(per_layer, proposer.vllm_config, num_tokens=num_input_tokens,
                             num_tokens_across_dp=across_dp, cudagraph_runtime_mode=mode,
                             slot_mapping=proposer._get_slot_mapping(slot_size, slot)):
        proposer.model(**model_kwargs)


STATES: list[SyncState] = []  # every proposer's state in this process, for tests and probes


def _state(proposer: Any) -> SyncState:
    state = proposer.__dict__.get("_spectune_sync")
    if state is None:
        state = proposer.__dict__["_spectune_sync"] = SyncState()
        STATES.append(state)
    return state


def _batch_rows(input_batch: Any, n: int, scheduled: dict[str, int]) -> list[tuple[str, int, int]]:
    """(request, first position of its tokens this step, tokens this step) for the batch's first ``n`` rows."""
    req_ids = input_batch.req_ids[:n]
    starts = input_batch.num_computed_tokens_cpu[:n]
    return [(r, int(starts[i]), int(scheduled.get(r, 0))) for i, r in enumerate(req_ids)]


def _without_speculation(runner: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a model runner method as a runner without a speculative config would: vLLM branches on
    ``speculative_config is not None`` (spec-decode metadata, the rejection sampler over zero drafts, the
    drafter's input preparation and the copy of its empty output), so a step with nothing to verify or propose
    takes the plain path."""
    spec, runner.speculative_config = runner.speculative_config, None
    try:
        return method(runner, *args, **kwargs)
    finally:
        runner.speculative_config = spec


def _skip_empty_draft_fetch() -> None:
    """In the engine process: after a step scheduled with k = 0, do not ask the worker for its drafts.

    vLLM's engine fetches each step's drafts from the worker with one more RPC after the step
    (``take_draft_token_ids``: a round trip to the worker process). After a k = 0 step there are none, and the
    scheduler already emptied every request's drafts when it scheduled the step, so the answer would change nothing.
    """
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    for cls in (MultiprocExecutor, UniProcExecutor):
        execute, take = cls.execute_model, cls.take_draft_token_ids

        def execute_model(self: Any, scheduler_output: Any, *args: Any, _execute: Any = execute, **kw: Any) -> Any:
            self._spectune_last_k = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
            return _execute(self, scheduler_output, *args, **kw)

        def take_draft_token_ids(self: Any, _take: Any = take) -> Any:
            if getattr(self, "_spectune_last_k", None) == 0:
                return None
            return _take(self)

        cls.execute_model = execute_model
        cls.take_draft_token_ids = take_draft_token_ids


def apply(mode: str | None = None) -> bool:
    """Install lazy sync in this process when ``mode`` (default: :data:`MODE_ENV`) is ``lazy``. True when
    installed."""
    if (mode or mode_from_env()) != "lazy":
        return False
    try:
        from vllm.v1.spec_decode.draft_model import DraftModelProposer
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # no vLLM here: nothing to install
        return False
    if getattr(DraftModelProposer, _PATCHED, False):
        return True
    import torch

    runner_propose = GPUModelRunner.propose_draft_token_ids
    proposer_propose = DraftModelProposer.propose

    def propose_draft_token_ids(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        # Under async scheduling (CUDA's default) a step's computed-token counts are optimistic until corrected, so
        # the positions this bookkeeping needs are not known here: vLLM's own sync runs there.
        if isinstance(drafter, DraftModelProposer) and not getattr(self, "use_async_scheduling", False):
            drafter._spectune_batch = (self.input_batch, self.requests, scheduler_output.num_scheduled_tokens)
        try:
            return runner_propose(self, scheduler_output, *args, **kwargs)
        finally:
            if isinstance(drafter, DraftModelProposer):
                drafter._spectune_batch = None

    def propose(self: Any, num_speculative_tokens: int, *args: Any, **kwargs: Any) -> Any:
        batch = getattr(self, "_spectune_batch", None)
        cad = kwargs.get("common_attn_metadata")
        if batch is None or cad is None:
            return proposer_propose(self, num_speculative_tokens, *args, **kwargs)
        state = _state(self)
        input_batch, live, scheduled = batch
        rows = _batch_rows(input_batch, cad.batch_size(), scheduled)
        state.forget_finished(live)
        if num_speculative_tokens == 0:
            state.skip(rows)
            self.num_speculative_tokens = 0
            self._last_draft_probs = None
            return torch.empty(len(rows), 0, device=self.device, dtype=torch.int64)
        ranges = state.catch_up(rows)
        if ranges:
            for segs in pack(ranges, self.max_num_tokens):
                _catch_up_forward(self, cad, input_batch.token_ids_cpu, segs)
        return proposer_propose(self, num_speculative_tokens, *args, **kwargs)

    runner_execute = GPUModelRunner.execute_model
    runner_sample = GPUModelRunner.sample_tokens

    def lazy_here(self: Any) -> bool:
        return isinstance(getattr(self, "drafter", None), DraftModelProposer) and not getattr(
            self, "use_async_scheduling", False)

    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._spectune_plain = lazy_here(self) and plain_step(scheduler_output)
        if not self._spectune_plain:
            return runner_execute(self, scheduler_output, *args, **kwargs)
        return _without_speculation(self, runner_execute, scheduler_output, *args, **kwargs)

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        plain, self._spectune_plain = getattr(self, "_spectune_plain", False), False
        if not plain or self.execute_model_state is None:
            return runner_sample(self, *args, **kwargs)
        # What the draft proposer would have recorded had it been asked for k = 0 drafts (it is not asked).
        state = _state(self.drafter)
        state.forget_finished(self.requests)
        scheduled = self.execute_model_state.scheduler_output.num_scheduled_tokens
        state.skip(_batch_rows(self.input_batch, self.input_batch.num_reqs, scheduled))
        state.plain_steps += 1
        return _without_speculation(self, runner_sample, *args, **kwargs)

    GPUModelRunner.execute_model = execute_model
    GPUModelRunner.sample_tokens = sample_tokens
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    DraftModelProposer.propose = propose
    setattr(DraftModelProposer, _PATCHED, True)
    _skip_empty_draft_fetch()
    from vllm.logger import init_logger

    init_logger(__name__).info("spectune: lazy draft KV sync (at k = 0 the draft does not run; it catches up when "
                               "drafting resumes)")
    return True
