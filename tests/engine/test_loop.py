"""The engine loop: greedy exactness for every k and schedule, exact sampling end to end, caches, bad input."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

import engine.model as M
from engine.loop import CATCHUP_INLINE, EngineConfig, Request, SpecEngine
from engine.model import BOS_ID, MODEL_PRESETS, CacheCapacityError, Transformer
from telemetry.records import RoundRecord

PROMPTS = [b"def f(x):\n    return", b"The quick brown fox", b'{"id": 1, "name"', b"import os\n" * 4, b"x"]


def _run(
    pair: tuple[Transformer, Transformer],
    policy: Callable[[str, int, int], int],
    max_batch: int,
    temperature: float = 0.0,
    n_new: int = 48,
    prompts: list[bytes] = PROMPTS,
    seed: int = 0,
) -> tuple[dict[str, list[int]], list[RoundRecord]]:
    eng = SpecEngine(*pair, EngineConfig(max_batch=max_batch, max_context=256, k_max=8, seed=seed), "t1", "d1")
    for j, p in enumerate(prompts):
        assert eng.submit(Request(str(j), ["code", "prose"][j % 2], p, n_new, temperature=temperature))
    records = []
    while not eng.idle():
        rec = eng.step(policy)
        assert rec is not None
        records.append(rec)
    return {c.request_id: c.output for c in eng.pop_finished()}, records


@pytest.fixture(scope="module")
def plain(pair: tuple[Transformer, Transformer]) -> dict[str, list[int]]:
    out, _ = _run(pair, lambda t, b, c: 0, max_batch=1)
    return out


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("max_batch", [1, 3])
def test_greedy_speculative_equals_plain_greedy(pair, plain, k: int, max_batch: int) -> None:
    out, recs = _run(pair, lambda t, b, c: k, max_batch=max_batch)
    assert out == plain
    assert all(r.max_k == k for r in recs)
    assert any(row.accepted > 0 for r in recs for row in r.rows)  # the draft is used, not bypassed


def test_random_on_off_schedule_is_exact(pair, plain) -> None:
    rng = random.Random(0)
    out, recs = _run(pair, lambda t, b, c: rng.choice([0, 0, 1, 2, 5, 8]), max_batch=4)
    assert out == plain
    ks = {row.k for r in recs for row in r.rows}
    assert 0 in ks and max(ks) > 1


def test_per_row_k_by_request_type(pair, plain) -> None:
    out, recs = _run(pair, lambda t, b, c: 6 if t == "code" else 0, max_batch=5)
    assert out == plain
    mixed = [r for r in recs if {row.k for row in r.rows} == {0, 6}]
    assert mixed, "rows of different k must share a round"


def test_draft_catches_up_after_speculation_was_off() -> None:
    # The draft is an exact copy: under greedy decoding every draft must be accepted, in particular in the first
    # round with k > 0 right after a stretch of k = 0. A draft cache that skipped the tokens decoded while
    # speculation was off would reject there (TensorRT-LLM #16888).
    torch.manual_seed(3)
    target = Transformer(MODEL_PRESETS["tiny"]).double().eval()
    draft = Transformer(MODEL_PRESETS["tiny"]).double().eval()
    draft.load_state_dict(target.state_dict())
    schedule = iter([4, 0, 0, 0, 0, 0, 4, 0, 0, 4, 4, 0, 4, 0, 2, 0, 0, 7] + [3] * 100)
    _, recs = _run((target, draft), lambda t, b, c: next(schedule), max_batch=1, prompts=[b"hello"], n_new=60)
    ks = [r.rows[0].k for r in recs]
    after_off = [i for i in range(1, len(recs)) if ks[i] > 0 and ks[i - 1] == 0]
    assert len(after_off) >= 5  # the schedule switches back on after k = 0 this often
    for i in after_off:
        assert recs[i].rows[0].accepted == ks[i], f"round {i}: draft rejected right after speculation was off"
    assert all(r.rows[0].accepted == r.rows[0].k for r in recs)


def test_admitted_prompt_does_not_widen_the_batch_draft_step(pair, plain, monkeypatch) -> None:
    # Rows are admitted while others decode at k = 3. A new row's draft catch-up is its whole prompt; padded
    # into the shared first draft step it would make every row pay for it. It must go in a forward of its own.
    draft = pair[1]
    widths: list[tuple[int, list[int]]] = []
    orig = draft.forward_cached

    def spy(tokens, cache, rows=None, real_lens=None):  # type: ignore[no-untyped-def]
        lens = [tokens.shape[1]] * tokens.shape[0] if real_lens is None else real_lens.tolist()
        widths.append((tokens.shape[1], lens))
        return orig(tokens, cache, rows, real_lens)

    monkeypatch.setattr(draft, "forward_cached", spy)
    out, _ = _run(pair, lambda t, b, c: 3, max_batch=2)
    assert out == plain
    wide = [lens for t, lens in widths if t > CATCHUP_INLINE]
    assert wide, "prompts longer than CATCHUP_INLINE were admitted"
    assert all(min(lens) > CATCHUP_INLINE - 1 for lens in wide), "a short catch-up was padded to a prompt"
    assert any(len(lens) == 2 and t <= CATCHUP_INLINE for t, lens in widths)  # shared steps stay narrow


def test_record_fields(pair) -> None:
    _, recs = _run(pair, lambda t, b, c: 3, max_batch=2)
    for r in recs:
        assert r.tokens_verified == sum(row.k + 1 for row in r.rows)  # packed: what the target really scored
        assert r.draft_s >= 0 and r.verify_s > 0 and r.other_s >= 0
        assert r.batch_size == len(r.rows)
        for row in r.rows:
            assert 0 <= row.accepted <= row.k
            assert 1 <= row.emitted <= row.accepted + 1


def test_prefill_is_timed_apart_from_the_round(pair, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Admission (the target's prefill of new prompts) is the same work whatever k is: it must not land in
    # other_s, where a round that happened to admit requests would make its k look dear to the policy.
    # The engine's clock is replaced by one that ticks TICK_S per reading and jumps PREFILL_S during a prefill,
    # so every span is known exactly, whatever the machine's load.
    import time

    import engine.loop as loop_mod

    TICK_S, PREFILL_S = 1e-3, 100.0

    class Clock:
        """``engine.loop``'s view of the time module: perf_counter is ours, the rest the real one."""

        now = 0.0

        def perf_counter(self) -> float:
            self.now += TICK_S
            return self.now

        def __getattr__(self, name: str) -> object:
            return getattr(time, name)

    clock = Clock()
    monkeypatch.setattr(loop_mod, "time", clock)
    orig = SpecEngine._prefill_target

    def slow(self, rows):  # type: ignore[no-untyped-def]
        clock.now += PREFILL_S
        return orig(self, rows)

    monkeypatch.setattr(SpecEngine, "_prefill_target", slow)
    _, recs = _run(pair, lambda t, b, c: 2, max_batch=2, n_new=24)
    admitting = [r for r in recs if r.prefill_s >= PREFILL_S]
    assert admitting and len(admitting) <= len(PROMPTS)  # one admission per prompt at most
    assert all(r.prefill_s < TICK_S * 10 for r in recs if r not in admitting)  # no prefill: one tick at most
    assert all(r.other_s < PREFILL_S and r.draft_s < PREFILL_S and r.verify_s < PREFILL_S for r in recs)
    assert all(r.wall_s == pytest.approx(r.draft_s + r.verify_s + r.other_s + r.prefill_s) for r in recs)


@torch.no_grad()
def _target_first_token_probs(target: Transformer, prompt: bytes) -> torch.Tensor:
    toks = torch.tensor([[BOS_ID, *prompt]], device=next(target.parameters()).device)
    return torch.softmax(target(toks)[0, -1].double(), -1).cpu()


def _first_tokens_against_target(
    pair: tuple[Transformer, Transformer], policy: Callable[[str, int, int], int], n_types: int, seed: int
) -> tuple[RoundRecord, float]:
    """One round of 3,000 one-token requests (request type ``j % n_types``) at T=1.0 under ``policy``.

    Returns the round and the total-variation distance between the first tokens and the target's distribution.
    """
    target, draft = pair
    prompt, n = b"ab", 3000
    p = _target_first_token_probs(target, prompt)
    eng = SpecEngine(target, draft, EngineConfig(max_batch=n, max_context=32, k_max=4, seed=seed), "t", "d")
    for j in range(n):
        eng.submit(Request(str(j), str(j % n_types), prompt, 1, temperature=1.0, stop_at_eos=False))
    rec = eng.step(policy)
    assert rec is not None
    first = torch.tensor([c.output[0] for c in eng.pop_finished()])
    emp = torch.bincount(first, minlength=p.numel()).double() / n
    return rec, float(0.5 * (emp - p).abs().sum())


@pytest.mark.slow
def test_sampling_preserves_target_distribution_end_to_end(pair) -> None:
    rec, tv = _first_tokens_against_target(pair, lambda t, b, c: 4, n_types=1, seed=5)
    assert sum(row.accepted for row in rec.rows) > 0
    # Only tokens with real mass matter for the bound; 3000 samples give a TV sampling error of ~0.05 here.
    assert tv < 0.12
    p, q = (_target_first_token_probs(m, b"ab") for m in pair)
    assert float(0.5 * (q - p).abs().sum()) > 0.0  # the draft really differs: acceptance did the correcting


def test_swap_target_keeps_requests(pair) -> None:
    target, draft = pair
    eng = SpecEngine(target, draft, EngineConfig(max_batch=2, max_context=256, k_max=4), "t1", "d1")
    for j in range(2):
        eng.submit(Request(str(j), "code", b"abc", 30, temperature=0.0))
    for _ in range(3):
        eng.step(lambda t, b, c: 2)
    eng.swap_target(target, "t2")
    while not eng.idle():
        rec = eng.step(lambda t, b, c: 2)
        assert rec is not None and rec.target_version == "t2"
    assert len(eng.pop_finished()) == 2


def test_bad_requests_are_rejected_and_loop_continues(pair) -> None:
    eng = SpecEngine(*pair, EngineConfig(max_batch=2, max_context=64, k_max=4), "t", "d")
    assert not eng.submit(Request("empty", "code", b"", 5))
    assert not eng.submit(Request("neg", "code", b"a", -1))
    assert not eng.submit(Request("big", "code", b"a" * 60, 10))
    assert not eng.submit(Request("temp", "code", b"a", 5, temperature=-1.0))
    assert not eng.submit(Request("bytes", "code", "text", 5))  # type: ignore[arg-type]
    assert eng.submit(Request("ok", "code", b"a", 5))
    reasons = dict(eng.rejected)
    assert "max_context" in reasons["big"] and "non-empty" in reasons["empty"]
    while not eng.idle():
        eng.step(lambda t, b, c: 2)
    assert [c.request_id for c in eng.pop_finished()] == ["ok"]


def test_cache_capacity_error_is_clear() -> None:
    m = Transformer(MODEL_PRESETS["tiny"])
    cache = m.new_cache(1, 8)
    m.forward_cached(torch.zeros(1, 6, dtype=torch.long), cache)
    with pytest.raises(CacheCapacityError, match="max_context"):
        m.forward_cached(torch.zeros(1, 4, dtype=torch.long), cache)


def test_kv_rollback_reproduces_logits() -> None:
    torch.manual_seed(0)
    m = Transformer(MODEL_PRESETS["tiny"]).double().eval()
    cache = m.new_cache(1, 32)
    toks = torch.randint(0, 256, (1, 10))
    ref = m.forward_cached(toks, cache)[0, -1]
    cache.rollback(0, 5)
    m.forward_cached(torch.randint(0, 256, (1, 3)), cache)  # overwrite positions 5..7 with other tokens
    cache.rollback(0, 5)
    again = m.forward_cached(toks[:, 5:], cache)[0, -1]
    assert torch.allclose(ref, again)
    with pytest.raises(ValueError):
        cache.rollback(0, 99)


def test_ragged_forward_matches_full_forward() -> None:
    torch.manual_seed(1)
    m = Transformer(MODEL_PRESETS["tiny"]).double().eval()
    a, b = torch.randint(0, 256, (1, 7)), torch.randint(0, 256, (1, 3))
    cache = m.new_cache(2, 16)
    buf = torch.zeros(2, 7, dtype=torch.long)
    buf[0], buf[1, :3] = a[0], b[0]
    out = m.forward_cached(buf, cache, real_lens=torch.tensor([7, 3]))
    assert torch.allclose(out[0], m(a)[0].float(), atol=1e-5)
    assert torch.allclose(out[1, :3], m(b)[0].float(), atol=1e-5)
    assert cache.lengths.tolist() == [7, 3]


def test_memory_report(pair) -> None:
    eng = SpecEngine(*pair, EngineConfig(max_batch=4, max_context=128), "t", "d")
    rep = eng.memory_report()
    assert rep["target_kv_bytes"] > 0 and rep["draft_weight_bytes"] > 0
    # The arithmetic the benchmark reports (without allocating) is what a cache really takes.
    assert pair[0].kv_cache_bytes(4, 128) == rep["target_kv_bytes"]
    assert pair[1].kv_cache_bytes(4, 128) == rep["draft_kv_bytes"]


def _linear_calls_in_one_round(
    pair: tuple[Transformer, Transformer], ks: list[int], watch: Transformer
) -> tuple[RoundRecord, list[int]]:
    """Rows ``type0..`` decode one round at per-row ``ks`` (after an admission round at k = 2).

    Returns the measured round and, for every call of a linear layer of ``watch`` during it, how many token
    vectors that call received. Decode-time forwards apply their linear layers through ``engine.model._lin``
    (no module hooks), so the spy wraps that.
    """
    target, draft = pair
    eng = SpecEngine(target, draft, EngineConfig(max_batch=len(ks), max_context=128, k_max=8), "t", "d")
    for j in range(len(ks)):
        assert eng.submit(Request(str(j), f"type{j}", b"abc", 40, temperature=0.0))
    eng.step(lambda t, b, c: 2)  # admission (prefill) happens here; the next round is the one measured
    seen: list[int] = []
    watched = {id(m) for m in watch.modules() if isinstance(m, torch.nn.Linear)}
    real_lin = M._lin

    def spy(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if id(m) in watched:
            seen.append(x.shape[:-1].numel())
        return real_lin(m, x)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(M, "_lin", spy)
        rec = eng.step(lambda t, b, c: ks[int(t[-1])])
    assert rec is not None and sorted(row.k for row in rec.rows) == sorted(ks)
    return rec, seen


def test_verification_is_packed_linear_layers_see_only_real_tokens(pair) -> None:
    # A round with per-row k of 0, 1, 3 and 8 must cost the target's token-wise layers sum(k + 1) = 16 tokens
    # per linear, not 4 x (8 + 1) = 36 as a padded implementation would.
    target = pair[0]
    rec, seen = _linear_calls_in_one_round(pair, [0, 1, 3, 8], watch=target)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in target.modules())
    assert len(seen) == n_linear  # one verify forward
    assert set(seen) == {16}
    assert rec.tokens_verified == 16


def test_draft_step_j_runs_only_rows_with_k_above_j(pair) -> None:
    # Draft step j (after the first) feeds only the rows with k > j: rows at k = 1, 3, 8 drafting in one round
    # make the later draft forwards 2 rows wide up to step 2 and 1 row wide after that.
    draft = pair[1]
    ks = [1, 3, 8]
    _, seen = _linear_calls_in_one_round(pair, ks, watch=draft)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in draft.modules())
    assert len(seen) == n_linear * max(ks)  # the first step (with the short catch-ups) plus kmax - 1 steps
    widths = seen[::n_linear]
    # Step 0 catches up (each row its unseen tokens, packed); steps 1..7 feed one draft per row still drafting.
    assert widths[1:] == [sum(k > j for k in ks) for j in range(1, max(ks))]


@pytest.mark.slow
def test_mixed_per_row_k_sampling_preserves_target_distribution(pair) -> None:
    # Exactness under packing: rows with k from 0 to 4 share the round; the first token of each row must still
    # follow the target's distribution.
    rec, tv = _first_tokens_against_target(pair, lambda t, b, c: int(t), n_types=5, seed=7)
    assert {row.k for row in rec.rows} == {0, 1, 2, 3, 4}
    assert rec.tokens_verified == sum(row.k + 1 for row in rec.rows)
    assert tv < 0.12


def test_restart_active_decodes_the_same_tokens_again(pair) -> None:
    # Greedy rows restarted from their prompts must produce what they produced the first time: the caches keep
    # the prompt and hold nothing of the dropped tokens (a stale target or draft position would change them).
    eng = SpecEngine(*pair, EngineConfig(max_batch=3, max_context=256, k_max=8), "t", "d")
    for j, p in enumerate(PROMPTS[:3]):
        assert eng.submit(Request(str(j), "code", p, 200, temperature=0.0))
    ks = [3, 0, 5, 8, 1] * 3
    first = []
    for k in ks:
        eng.step(lambda t, b, c, k=k: k)
        first.append([list(s.generated) for s in eng.slots if s is not None])
    eng.restart_active()
    assert all(s is not None and s.generated == [] and len(s.tokens) == s.prompt_len for s in eng.slots)
    again = []
    for k in [6, 2, 0, 8, 4] * 3:  # another schedule: greedy output does not depend on k
        eng.step(lambda t, b, c, k=k: k)
        again.append([list(s.generated) for s in eng.slots if s is not None])
    n = min(len(g) for g in again[-1] + first[-1])
    assert n > 10
    assert [g[:n] for g in again[-1]] == [g[:n] for g in first[-1]]
    assert eng.t_cache.lengths.tolist() == [len(s.tokens) - 1 for s in eng.slots if s is not None]


def _slot_types(eng: SpecEngine) -> list[str | None]:
    return [None if s is None else s.req.request_type for s in eng.slots]


def _runs(types: list[str | None]) -> int:
    live = [t for t in types if t is not None]
    return sum(1 for j, t in enumerate(live) if j == 0 or live[j - 1] != t)


@pytest.mark.parametrize("layout", ["grouped", "first_free"])
def test_slots_keep_a_types_rows_together(pair, layout: str) -> None:
    # Nine interleaved arrivals of three types fill nine slots: by type they form three blocks (three attention
    # runs), first-free interleaves them (nine runs). A retired row's slot goes to a row of its own type.
    eng = SpecEngine(*pair, EngineConfig(max_batch=9, max_context=128, k_max=4, slot_layout=layout), "t", "d")
    for j in range(9):
        req = Request(str(j), ["code", "prose", "structured"][j % 3], b"abc", 4 + j, temperature=0.0, stop_at_eos=False)
        assert eng.submit(req)
    eng.step(lambda t, b, c: 0)
    assert _runs(_slot_types(eng)) == (3 if layout == "grouped" else 9)
    while eng.active == 9:  # the shortest request (4 new tokens, code) retires first
        eng.step(lambda t, b, c: 0)
    hole = _slot_types(eng).index(None)
    assert eng.submit(Request("new", "code", b"xyz", 8, temperature=0.0, stop_at_eos=False))
    eng.step(lambda t, b, c: 0)
    assert _slot_types(eng)[hole] == "code"
    if layout == "grouped":
        assert _runs(_slot_types(eng)) == 3


def test_bad_slot_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="slot_layout"):
        EngineConfig(slot_layout="random")


def test_rows_swap_slots_to_group_by_k_and_stay_exact(pair, plain, monkeypatch) -> None:
    # A random k per row every round: the grouped layout swaps rows (and their caches) so that equal k sit
    # together; greedy output must still equal plain decoding, and every round's k must form one run per
    # distinct k over the live slots.
    swaps = []
    real_swap = SpecEngine._group_by_k

    def counting(self: SpecEngine, live: list[int], ks: list[int]) -> list[int]:
        before = [id(self.slots[i]) for i in live]
        out = real_swap(self, live, ks)
        swaps.append(sum(a != b for a, b in zip(before, [id(self.slots[i]) for i in live], strict=True)))
        assert sum(1 for j in range(len(out)) if j == 0 or out[j] != out[j - 1]) == len(set(out))
        return out

    monkeypatch.setattr(SpecEngine, "_group_by_k", counting)
    rng = random.Random(3)
    out, _ = _run(pair, lambda t, b, c: rng.choice([0, 2, 8]), max_batch=4)  # a k per row, not per type
    assert out == plain
    assert sum(swaps) > 0, "rows never moved: the test did not exercise a swap"


def test_swap_rows_exchanges_cached_positions() -> None:
    torch.manual_seed(4)
    m = Transformer(MODEL_PRESETS["tiny"]).double().eval()
    cache = m.new_cache(3, 32)
    a, b = torch.randint(0, 256, (1, 9)), torch.randint(0, 256, (1, 5))
    m.forward_cached(a, cache, torch.tensor([0]))
    m.forward_cached(b, cache, torch.tensor([2]))
    cache.swap_rows(0, 2)
    assert cache.lengths.tolist() == [5, 0, 9]
    nxt = torch.randint(0, 256, (2, 1))
    out = m.forward_cached(nxt, cache, torch.tensor([2, 0]))  # row 2 now holds a's prefix, row 0 b's
    assert torch.allclose(out[0, 0], m(torch.cat([a, nxt[:1]], 1))[0, -1].float(), atol=1e-6)
    assert torch.allclose(out[1, 0], m(torch.cat([b, nxt[1:]], 1))[0, -1].float(), atol=1e-6)
