"""The reference speculative-decoding engine: continuous batching with a per-row draft length.

Vocabulary (see ``telemetry/records.py`` for the full definitions): a **round** is one draft-then-verify step
over the current batch; a **row** is one sequence in it, with its own ``k`` (0 = speculation off for that row).
``accepted`` drafts are kept by the target, ``emitted = accepted + 1`` tokens are appended (the extra one is the
bonus token when every draft was kept, the correction token otherwise). Verification follows Leviathan et al.
2023 (arXiv 2211.17192) and Chen et al. 2023 (arXiv 2302.01318); see :mod:`engine.sampling`.

Cache invariant per row: ``tokens`` holds the prompt (with BOS) and everything generated. The target's cache
holds ``tokens[:-1]``; the last token is fed at the start of the next round. The draft's cache holds a prefix of
that, possibly shorter (after rounds with speculation off or after a rejection): before drafting it catches up
on the tokens it has not seen, in the same forward as its first draft step, so switching ``k`` between 0 and
``k > 0`` loses nothing (the failure mode of TensorRT-LLM issue #16888 is a draft cache that skipped tokens).

The engine returns a :class:`~telemetry.records.RoundRecord` from every :meth:`SpecEngine.step`; it never logs.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.model import BOS_ID, EOS_ID, CacheCapacityError, Transformer
from engine.sampling import RowSampling, rejection_sample, sample
from telemetry.records import MAX_DRAFT_LEN, RoundRecord, RowRecord

PolicyFn = Callable[[str, int, int], int]  # (request type, batch size, context length) -> k, 0 = off
CATCHUP_INLINE = 4  # draft catch-ups up to this many tokens ride in the first draft step; longer ones go first
SLOT_LAYOUTS = ("grouped", "first_free")


class RequestError(ValueError):
    """A request was rejected at submission; the engine keeps running."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits and defaults."""

    max_batch: int = 64  # rows decoded together; waiting requests are admitted as rows retire
    max_context: int = 2048  # cache positions per row (prompt + generated + one draft window)
    k_max: int = 8  # largest draft length a policy may ask for
    seed: int = 0  # the engine's own RNG for draft sampling and acceptance coins
    # "grouped": a request goes to a free slot next to rows of its type, and each round rows swap slots so
    # that rows sharing a k sit in consecutive cache rows, where attention and drafting run per run of them
    # over views (see _place and _group_by_k); "first_free": the lowest free slot, rows never move (types
    # interleave as they arrive).
    slot_layout: str = "grouped"

    def __post_init__(self) -> None:
        if self.slot_layout not in SLOT_LAYOUTS:
            raise ValueError(f"slot_layout must be one of {', '.join(SLOT_LAYOUTS)}, got {self.slot_layout!r}")
        if self.max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {self.max_batch}")
        if not 0 <= self.k_max <= MAX_DRAFT_LEN:
            raise ValueError(f"k_max must be in [0, {MAX_DRAFT_LEN}], got {self.k_max}")
        if self.max_context <= self.k_max + 2:
            raise ValueError(f"max_context={self.max_context} leaves no room for a prompt and k_max drafts")


@dataclass(frozen=True)
class Request:
    """One generation request. ``temperature == 0`` is greedy decoding."""

    request_id: str
    request_type: str
    prompt: bytes
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_at_eos: bool = True  # benchmarks turn this off to decode a fixed number of tokens


@dataclass
class Completion:
    """A finished request and its per-request acceptance counts."""

    request_id: str
    request_type: str
    output: list[int]  # generated token ids (bytes, plus EOS if it ended the row)
    finish_reason: str  # "eos" | "length"
    rounds: int
    drafted: int
    accepted: int

    @property
    def text(self) -> bytes:
        return bytes(t for t in self.output if t < 256)


@dataclass
class _Row:
    req: Request
    tokens: list[int]
    prompt_len: int
    draft_len: int = 0  # positions in the draft cache (a prefix of tokens)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: list[int] = field(default_factory=list)


def validate_request(req: Request, max_context: int, k_max: int) -> None:
    """Reject a request the engine cannot serve, with what to do instead."""
    if not isinstance(req.prompt, bytes | bytearray) or len(req.prompt) == 0:
        raise RequestError(f"request {req.request_id!r}: prompt must be non-empty bytes")
    if not isinstance(req.max_new_tokens, int) or req.max_new_tokens <= 0:
        raise RequestError(f"request {req.request_id!r}: max_new_tokens must be a positive int")
    if not req.request_type or not isinstance(req.request_type, str):
        raise RequestError(f"request {req.request_id!r}: request_type must be a non-empty string")
    if not (req.temperature >= 0.0) or req.temperature != req.temperature:
        raise RequestError(f"request {req.request_id!r}: temperature must be >= 0 (0 = greedy)")
    if not 0.0 < req.top_p <= 1.0:
        raise RequestError(f"request {req.request_id!r}: top_p must be in (0, 1]")
    need = 1 + len(req.prompt) + req.max_new_tokens + k_max + 1
    if need > max_context:
        raise RequestError(
            f"request {req.request_id!r} needs {need} cache positions (BOS + prompt + max_new_tokens + "
            f"k_max + 1) but max_context is {max_context}; shorten the prompt or max_new_tokens, or start the "
            "engine with a larger max_context"
        )


@dataclass(frozen=True, slots=True)
class _RoundSpans:
    """Seconds of one round's phases, in the order :meth:`SpecEngine.step` marks them."""

    prefill: float  # admitting new requests: the target's prefill of their prompts (kept apart, see RoundRecord)
    setup: float  # policy lookups and the round's input tensors
    draft: float
    verify: float
    bookkeeping: float  # appending the kept tokens, rolling caches back, retiring finished rows

    @property
    def other(self) -> float:
        """Decode work that is neither drafting nor verifying (``RoundRecord.other_s``)."""
        return self.setup + self.bookkeeping


class _Clock:
    """Phase timing: CUDA events on a GPU (device time, one sync per round), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[object] = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks (synchronises once on CUDA)."""
        if self.cuda:
            self.marks[-1].synchronize()  # type: ignore[attr-defined]
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]  # type: ignore[attr-defined]
        m = self.marks
        return [float(b) - float(a) for a, b in itertools.pairwise(m)]  # type: ignore[arg-type]


class SpecEngine:
    """Batched speculative decoding of a target model with a draft model, one round per :meth:`step`."""

    def __init__(
        self,
        target: Transformer,
        draft: Transformer,
        config: EngineConfig,
        target_version: str,
        draft_version: str,
    ) -> None:
        dev = next(target.parameters()).device
        if next(draft.parameters()).device != dev:
            raise ValueError("target and draft must live on the same device")
        self.cfg = config
        self.device = dev
        self.target, self.draft = target.prepare_inference(), draft.prepare_inference()
        self.target_version, self.draft_version = target_version, draft_version
        cap = min(config.max_context, target.cfg.max_seq_len, draft.cfg.max_seq_len)
        self.t_cache = target.new_cache(config.max_batch, cap)
        self.d_cache = draft.new_cache(config.max_batch, cap)
        self.capacity = cap
        self.gen = torch.Generator(device=dev).manual_seed(config.seed)
        self.waiting: deque[Request] = deque()
        self.slots: list[_Row | None] = [None] * config.max_batch
        self.finished: list[Completion] = []
        self.round_index = 0
        self.rejected: list[tuple[str, str]] = []  # (request id, reason): kept for operators, never raised

    # ------------------------------------------------------------------------------------------- public
    def submit(self, req: Request) -> bool:
        """Queue a request. A bad request is recorded in ``rejected`` and ``False`` is returned."""
        try:
            validate_request(req, self.capacity, self.cfg.k_max)
        except RequestError as e:
            self.rejected.append((str(req.request_id), str(e)))
            return False
        self.waiting.append(req)
        return True

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.slots)

    def idle(self) -> bool:
        return not self.waiting and self.active == 0

    def pop_finished(self) -> list[Completion]:
        out, self.finished = self.finished, []
        return out

    def memory_report(self) -> dict[str, int]:
        """Bytes of weights and of KV cache for target and draft (the draft costs memory too)."""
        return {
            "target_weight_bytes": self.target.weight_bytes(),
            "draft_weight_bytes": self.draft.weight_bytes(),
            "target_kv_bytes": self.t_cache.nbytes,
            "draft_kv_bytes": self.d_cache.nbytes,
        }

    @torch.no_grad()
    def swap_target(self, target: Transformer, version: str) -> None:
        """Replace the target (a model update); active rows are re-prefilled so no request is lost."""
        if target.cfg != self.target.cfg:
            raise ValueError("the new target must have the same shape as the old one")
        self.target = target.prepare_inference()
        self.target_version = version
        live = [i for i, s in enumerate(self.slots) if s is not None]
        for i in live:
            self.t_cache.reset_row(i)
        if live:
            self._prefill_target(live)

    def restart_active(self) -> None:
        """Send every active request back to the end of its prompt, keeping the prompt's cached keys.

        What it generated is dropped and it decodes again from there (with fresh random draws when sampling).
        Benchmarks use it to hold the context length still while they measure many rounds; the caches keep
        their invariant (the target holds ``tokens[:-1]``, the draft a prefix of it).
        """
        for i, s in enumerate(self.slots):
            if s is None:
                continue
            del s.tokens[s.prompt_len :]
            s.generated.clear()
            self.t_cache.rollback(i, s.prompt_len - 1)
            self.d_cache.lengths[i] = min(int(self.d_cache.lengths[i]), s.prompt_len - 1)
            s.draft_len = int(self.d_cache.lengths[i])

    @torch.no_grad()
    def step(self, policy: PolicyFn) -> RoundRecord | None:
        """Admit waiting requests, run one round, retire finished rows. None when there is nothing to do."""
        clock = _Clock(self.device)
        clock.mark()
        self._admit()
        live = [i for i, s in enumerate(self.slots) if s is not None]
        if not live:
            return None
        clock.mark()  # --- end of admission (the target's prefill of new prompts)
        bsz = len(live)
        rows_k = []
        for i in live:
            s = self.slots[i]
            assert s is not None
            k = int(policy(s.req.request_type, bsz, len(s.tokens)))
            rows_k.append(min(max(k, 0), self.cfg.k_max))
        if self.cfg.slot_layout == "grouped":
            rows_k = self._group_by_k(live, rows_k)
        kmax = max(rows_k)
        k_t = torch.tensor(rows_k, dtype=torch.long)
        sampling = RowSampling.of(
            [self._row(i).req.temperature for i in live], [self._row(i).req.top_p for i in live], self.device
        )
        contexts = [len(self._row(i).tokens) for i in live]
        clock.mark()  # --- end of the round's set-up (other)

        draft_tokens, draft_probs = self._draft(live, rows_k, kmax, sampling)
        clock.mark()  # --- end of drafting

        # Verify: each row feeds its last token and its k drafts. The target's token-wise work runs on the
        # sum(k_i + 1) real tokens (packed); only attention sees rows padded to kmax + 1.
        last = torch.tensor([self._row(i).tokens[-1] for i in live], dtype=torch.long, device=self.device)
        verify_in = torch.cat([last[:, None], draft_tokens], dim=1)  # [B, kmax + 1]
        rows_cpu = torch.tensor(live, dtype=torch.long)
        logits = self.target.forward_cached(verify_in, self.t_cache, rows_cpu, k_t + 1)  # [B, kmax + 1, V]
        target_probs = sampling.probs(logits)
        accepted, next_tok = rejection_sample(draft_tokens, draft_probs, target_probs, k_t.to(self.device), self.gen)
        accepted_l = accepted.tolist()  # the round's one device -> host sync
        next_l = next_tok.tolist()
        drafts_l = draft_tokens.tolist()
        clock.mark()  # --- end of verify

        row_records = []
        for j, i in enumerate(live):
            s = self._row(i)
            a = accepted_l[j]
            new = [*drafts_l[j][:a], next_l[j]]
            kept = self._append(s, new)
            # Target cache: it scored the last token and every draft; keep what precedes the new last token.
            self.t_cache.rollback(i, len(s.tokens) - 1)
            # Draft cache: it saw the last token and drafts d_1..d_{kmax-1}; keep only the accepted prefix.
            self.d_cache.lengths[i] = min(int(self.d_cache.lengths[i]), len(s.tokens) - 1)
            s.draft_len = int(self.d_cache.lengths[i])
            s.rounds += 1
            s.drafted += rows_k[j]
            s.accepted += a
            row_records.append(RowRecord(s.req.request_type, contexts[j], rows_k[j], a, kept))
            self._maybe_retire(i)
        clock.mark()  # --- end of bookkeeping
        spans = _RoundSpans(*clock.spans())
        self.round_index += 1
        return RoundRecord(
            round_index=self.round_index - 1,
            batch_size=bsz,
            max_k=kmax,
            tokens_verified=sum(rows_k) + bsz,  # packed: sum over rows of k + 1
            draft_s=spans.draft,
            verify_s=spans.verify,
            other_s=spans.other,
            target_version=self.target_version,
            draft_version=self.draft_version,
            rows=tuple(row_records),
            timestamp=time.time(),
            prefill_s=spans.prefill,
        )

    # ------------------------------------------------------------------------------------------ internals
    def _row(self, i: int) -> _Row:
        s = self.slots[i]
        assert s is not None, f"slot {i} is empty"
        return s

    def _admit(self) -> None:
        new = []
        while self.waiting and None in self.slots:
            req = self.waiting.popleft()
            i = self._place(req.request_type)
            toks = [BOS_ID, *req.prompt]
            self.slots[i] = _Row(req=req, tokens=toks, prompt_len=len(toks))
            self.t_cache.reset_row(i)
            self.d_cache.reset_row(i)
            new.append(i)
        if new:
            self._prefill_target(new)

    def _place(self, request_type: str) -> int:
        """The free slot a new request of ``request_type`` takes.

        ``grouped``: rows of one type grow as a block. Best is a slot touching a row of the type; then one whose
        nearest live rows (left and right) are of the type rather than another; among slots near no row of the
        type, the one farthest from any live row, which leaves a new type room to grow. Ties: the lowest slot.
        Attention runs per run of consecutive cache rows with one token count (``engine.model.attention_groups``)
        and a draft step over the rows still drafting reads views of such runs, so a batch whose types sit in
        blocks pays for per-type k only on the rows that use it.
        """
        free = [i for i, s in enumerate(self.slots) if s is None]
        if self.cfg.slot_layout == "first_free" or len(free) == len(self.slots):
            return free[0]
        n = len(self.slots)
        types = [None if s is None else s.req.request_type for s in self.slots]
        left: list[int | None] = [None] * n  # nearest live slot to the left of each slot
        right: list[int | None] = [None] * n
        last: int | None = None
        for i in range(n):
            left[i] = last
            if types[i] is not None:
                last = i
        last = None
        for i in reversed(range(n)):
            right[i] = last
            if types[i] is not None:
                last = i

        def score(i: int) -> tuple[int, int, int, int]:
            near = [j for j in (left[i], right[i]) if j is not None]
            same = [j for j in near if types[j] == request_type]
            touching = any(abs(j - i) == 1 for j in same)
            dist = min((abs(j - i) for j in near), default=n)
            room = -min(abs(j - i) for j in same) if same else dist
            return (touching, len(same) - (len(near) - len(same)), room, -i)

        return max(free, key=score)

    def _group_by_k(self, live: list[int], ks: list[int]) -> list[int]:
        """Swap rows between the live slots so that rows with the same k sit together. Returns the k of each
        live slot afterwards.

        Attention and the draft's steps run per run of consecutive cache rows with one token count
        (``engine.model.attention_groups``); rows of one k scattered among others would make every run one row
        long. Blocks keep the order of their k's mean slot, so a layout that is grouped but for a newly admitted
        row (the usual case) costs that row one swap per block it must cross. A swap copies two rows' cached
        positions in both caches (on the xl pair, about 3 MB a row at 300 positions).
        """
        n = len(ks)
        runs = sum(1 for j in range(n) if j == 0 or ks[j] != ks[j - 1])
        where: dict[int, list[int]] = {}
        for j, k in enumerate(ks):
            where.setdefault(k, []).append(j)
        if runs <= len(where):
            return ks
        order = sorted(where, key=lambda k: sum(where[k]) / len(where[k]))
        target = [k for k in order for _ in where[k]]
        cur = list(ks)
        for j in range(n):
            if cur[j] == target[j]:
                continue
            cands = [m for m in range(j + 1, n) if cur[m] == target[j] and cur[m] != target[m]]
            m = next((c for c in cands if target[c] == cur[j]), cands[0])  # a two-way exchange when one exists
            a, b = live[j], live[m]
            self.slots[a], self.slots[b] = self.slots[b], self.slots[a]
            self.t_cache.swap_rows(a, b)
            self.d_cache.swap_rows(a, b)
            cur[j], cur[m] = cur[m], cur[j]
        return cur

    def _prefill_target(self, rows: list[int]) -> None:
        """Feed ``tokens[:-1]`` of each row into the target cache (ragged, one forward)."""
        seqs = [self._row(i).tokens[:-1] for i in rows]
        self._ragged_forward(self.target, self.t_cache, rows, seqs)

    def _ragged_forward(
        self, model: Transformer, cache: object, rows: list[int], seqs: list[list[int]]
    ) -> torch.Tensor:
        """Right-pad ``seqs`` and append them to ``rows`` of ``cache``. Returns logits ``[R, T, V]``."""
        lens_l = [len(s) for s in seqs]
        t = max(lens_l)
        lens = torch.tensor(lens_l, dtype=torch.long)
        buf = torch.tensor([s + [0] * (t - len(s)) for s in seqs], dtype=torch.long)  # [R, T]: one copy, not R
        return model.forward_cached(
            buf.to(self.device, non_blocking=True), cache, torch.tensor(rows, dtype=torch.long), lens  # type: ignore[arg-type]
        )

    def _draft(
        self, live: list[int], rows_k: list[int], kmax: int, sampling: RowSampling
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft ``kmax`` steps for the rows with ``k > 0``.

        Returns:
            draft_tokens: ``[B, kmax]`` int64 (zeros for rows with k = 0 and past each row's k).
            draft_probs: ``[B, kmax, V]`` (uniform filler where no draft was made; never read there).
        """
        b = len(live)
        vocab = self.target.cfg.vocab_size
        tokens = torch.zeros(b, kmax, dtype=torch.long, device=self.device)
        probs = torch.full((b, kmax, vocab), 1.0 / vocab, device=self.device)
        if kmax == 0:
            return tokens, probs
        sel = [j for j in range(b) if rows_k[j] > 0]
        rows = [live[j] for j in sel]
        sel_t = torch.tensor(sel, dtype=torch.long, device=self.device)
        # First step: catch up on every token the draft has not seen (at least the last one), in one forward.
        seqs = [self._row(i).tokens[int(self.d_cache.lengths[i]) :] for i in rows]
        # A row just admitted (its whole prompt) or back from a stretch at k = 0 has a long catch-up. Padded
        # into the batch's first step it would widen that forward for every row ([64, 129] instead of [64, 2]
        # when one 128-byte prompt joins a batch of 64): such rows feed all but their last token in a forward
        # of their own, so the shared first step stays at most CATCHUP_INLINE tokens wide.
        long_j = [j for j, s in enumerate(seqs) if len(s) > CATCHUP_INLINE]
        if long_j:
            self._ragged_forward(self.draft, self.d_cache, [rows[j] for j in long_j], [seqs[j][:-1] for j in long_j])
            for j in long_j:
                seqs[j] = seqs[j][-1:]
        logits = self._ragged_forward(self.draft, self.d_cache, rows, seqs)
        last_idx = torch.tensor([len(s) - 1 for s in seqs], device=self.device)
        step_logits = logits[torch.arange(len(rows), device=self.device), last_idx][:, None]  # [S, 1, V]
        ks = [rows_k[j] for j in sel]
        active = list(range(len(sel)))  # positions in sel of the rows drafting at this step
        whole = len(sel) == b  # every row drafts: index the batch by slices, not by gathers
        idx, step_rows = sel_t, torch.tensor(rows, dtype=torch.long)
        step_sampling = sampling if whole else sampling.select(sel_t)
        d = torch.zeros(0, dtype=torch.long, device=self.device)
        for step in range(kmax):
            if step > 0:
                # Step j runs only the rows still drafting (k > j): a row's k decides what its drafts cost.
                still = [a for a, pos in enumerate(active) if ks[pos] > step]  # of last step's rows, those going on
                if len(still) < len(active):  # some rows stopped: narrow the step (uniform k never does)
                    whole = False
                    active = [active[a] for a in still]
                    d = d[torch.tensor(still, device=self.device)]
                    idx = sel_t[torch.tensor(active, device=self.device)]  # [S_j] positions in the batch
                    step_rows = torch.tensor([rows[a] for a in active], dtype=torch.long)
                    step_sampling = sampling.select(idx)
                step_logits = self.draft.forward_cached(d[:, None], self.d_cache, step_rows)
            at: slice | torch.Tensor = slice(None) if whole else idx  # a slice writes in place, a gather copies
            q = step_sampling.probs(step_logits)[:, 0]  # [S_j, V]
            d = sample(q, self.gen)  # [S_j]
            tokens[at, step] = d
            probs[at, step] = q
        return tokens, probs

    def _append(self, s: _Row, new: list[int]) -> int:
        """Append emitted tokens, stopping at EOS or max_new_tokens. Returns how many were kept."""
        kept = 0
        for tok in new:
            if len(s.generated) >= s.req.max_new_tokens:
                break
            s.tokens.append(tok)
            s.generated.append(tok)
            kept += 1
            if tok == EOS_ID and s.req.stop_at_eos:
                break
        return kept

    def _maybe_retire(self, i: int) -> None:
        s = self._row(i)
        eos = bool(s.generated) and s.generated[-1] == EOS_ID and s.req.stop_at_eos
        if eos or len(s.generated) >= s.req.max_new_tokens:
            self.finished.append(
                Completion(
                    request_id=s.req.request_id,
                    request_type=s.req.request_type,
                    output=list(s.generated),
                    finish_reason="eos" if eos else "length",
                    rounds=s.rounds,
                    drafted=s.drafted,
                    accepted=s.accepted,
                )
            )
            self.slots[i] = None


__all__ = [
    "CacheCapacityError",
    "Completion",
    "EngineConfig",
    "PolicyFn",
    "Request",
    "RequestError",
    "SpecEngine",
]
