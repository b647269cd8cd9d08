"""Closed-form speculative-decoding maths, as pure functions.

Everything here follows Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative Decoding",
ICML 2023, arXiv:2211.17192. Vocabulary (see ``telemetry/records.py``): a row drafts ``k`` tokens, the target keeps
``accepted`` of them and adds one bonus/correction token, so a round emits ``accepted + 1`` tokens. ``alpha`` is
the per-token acceptance probability, ``c`` the cost of one draft step relative to one target forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

ALPHA_ONE_EPS = 1e-9  # below this distance from 1 use the limit k + 1 of the geometric sum
MAX_JOINT_COMBOS = 20_000  # joint per-type search in batch_goodput; larger grids fall back to one shared k


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by one round (Leviathan et al. 2023, eq. 1).

    ``E[emitted] = (1 - alpha^(k+1)) / (1 - alpha)``; as ``alpha -> 1`` this tends to ``k + 1``.

    Args:
        alpha: per-token acceptance probability in [0, 1].
        k: draft length (0 = no speculation: exactly one token).

    Returns:
        Expected emitted tokens, in [1, k + 1].
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if 1.0 - alpha < ALPHA_ONE_EPS:
        return float(k + 1)
    return float((1.0 - alpha ** (k + 1)) / (1.0 - alpha))


def expected_tokens_vec(alpha: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Vectorised :func:`expected_tokens` with numpy broadcasting.

    Args:
        alpha: acceptance probabilities, any shape, values in [0, 1].
        k: draft lengths, broadcastable against ``alpha``.

    Returns:
        Expected emitted tokens with the broadcast shape.
    """
    a = np.asarray(alpha, dtype=float)
    kk = np.asarray(k, dtype=float)
    near_one = (1.0 - a) < ALPHA_ONE_EPS
    safe = np.where(near_one, 0.5, a)
    geo = (1.0 - safe ** (kk + 1.0)) / (1.0 - safe)
    return np.where(near_one, kk + 1.0, geo)


def expected_tokens_from_curve(curve: Sequence[float] | np.ndarray) -> float:
    """Expected emitted tokens from a measured acceptance curve (general form of eq. 1).

    ``E[emitted] = 1 + sum_i P(accepted >= i)``: the bonus token plus the expected number of accepted drafts
    (tail-sum formula for a non-negative integer variable). With ``P(accepted >= i) = alpha^i`` this is eq. 1.

    Args:
        curve: ``[k]`` values P(accepted >= i | k) for i = 1..k, non-increasing in [0, 1].
    """
    c = np.asarray(curve, dtype=float)
    if c.size and (np.any(c < 0) or np.any(c > 1)):
        raise ValueError("acceptance curve values must lie in [0, 1]")
    return float(1.0 + c.sum())


def emitted_by_k(cond: np.ndarray) -> np.ndarray:
    """Expected emitted tokens for every k from per-position conditional acceptance.

    Args:
        cond: ``[..., K]`` P(position i accepted | positions < i accepted), i = 1..K.

    Returns:
        ``[..., K + 1]``: entry k is ``1 + sum_{i<=k} prod_{j<=i} cond_j`` (k = 0 gives 1).
    """
    surv = np.cumprod(cond, axis=-1)  # [..., K]: P(accepted >= i)
    zeros = np.zeros((*surv.shape[:-1], 1))
    return 1.0 + np.concatenate([zeros, np.cumsum(surv, axis=-1)], axis=-1)


def speedup(alpha: float, k: int, c: float) -> float:
    """Expected wall-time improvement factor (Leviathan et al. 2023, Theorem 3.8).

    ``(1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))``: expected tokens per round over the round's cost in units of
    one target forward (k draft steps of cost c plus one verify forward).

    Args:
        alpha: per-token acceptance probability in [0, 1].
        k: draft length.
        c: draft step cost relative to a target forward, >= 0.
    """
    if c < 0:
        raise ValueError(f"c must be >= 0, got {c}")
    return expected_tokens(alpha, k) / (k * c + 1.0)


def optimal_draft_length(alpha: float, c: float, k_max: int) -> int:
    """The k in [0, k_max] maximising :func:`speedup` (ties go to the smaller k).

    k = 0 (speedup 1) wins whenever no k >= 1 beats plain decoding; the paper's Corollary 3.9 condition
    ``alpha > c`` is what makes some k >= 1 worthwhile.
    """
    if k_max < 0:
        raise ValueError(f"k_max must be >= 0, got {k_max}")
    ks = np.arange(k_max + 1)
    s = expected_tokens_vec(np.full(ks.shape, alpha), ks) / (ks * c + 1.0)
    return int(np.argmax(s))


def batch_goodput(
    emitted: np.ndarray, mix: np.ndarray, batch_size: float, round_s: np.ndarray, shared_k: bool = False,
    per_token_s: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Expected goodput of every joint per-type choice of k in a batch that drafts to its largest k.

    Rows of type t make up a fraction ``mix[t]`` of the batch; a round of ``batch_size`` rows runs draft steps up
    to the largest k present, so ``P(max k <= m) = (1 - sum_{t: k_t > m} mix_t) ** batch_size``. Under packed
    verification a row drafting less than the round's largest k also costs less: each token it does not draft
    saves ``per_token_s`` (draft row-step and verified position), so

        E[seconds] = sum_m P(max k = m) round_s[m] - per_token_s * batch_size * (E[max k] - sum_t mix_t k_t).

    With ``per_token_s = 0`` a round costs what its largest k costs (padded verification). Goodput is emitted
    tokens per second over the long run: expected emitted per round over expected round seconds.

    Args:
        emitted: ``[T, K + 1]`` expected emitted tokens per row for each type and k.
        mix: ``[T]`` type fractions of the rows (normalised here).
        batch_size: rows per round (>= 1).
        round_s: ``[K + 1]`` expected seconds of a round in which every row drafts m.
        shared_k: force one k for every type (also used when the joint grid is too large).
        per_token_s: seconds one drafted token adds to a round (>= 0).

    Returns:
        ``(combos [C, T] int, goodput [C])``.
    """
    n_types, n_k = emitted.shape
    w = np.asarray(mix, dtype=float)
    w = w / w.sum()
    combos = _combos(n_types, n_k, shared_k)
    tok = batch_size * (emitted[np.arange(n_types)[None, :], combos] * w[None, :]).sum(axis=1)  # [C]
    m = np.arange(n_k)
    over = combos[:, :, None] > m[None, None, :]  # [C, T, K+1]: type t drafts past m
    cdf = np.clip(1.0 - (over * w[None, :, None]).sum(axis=1), 0.0, 1.0) ** batch_size  # [C, K+1]
    pmf = np.diff(cdf, axis=1, prepend=0.0)
    round_s = np.asarray(round_s, dtype=float)
    secs = pmf @ round_s  # [C]
    if per_token_s > 0:
        undrafted = batch_size * (pmf @ m - combos @ w)  # [C] E[tokens below the round's largest k], >= 0
        secs = np.maximum(secs - per_token_s * np.maximum(undrafted, 0.0), 0.5 * round_s[0])
    return combos, tok / np.maximum(secs, 1e-12)


def solo_goodput(emitted: np.ndarray, mix: np.ndarray, round_s: np.ndarray,
                 shared_k: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Expected goodput of every joint per-type choice of k when each round holds one row (batch size 1).

    A row then runs alone at its own k, and a request needs its tokens whatever k is: choosing k changes how many
    rounds it takes, not its share of the tokens. Goodput is the token-weighted harmonic mean of the per-type
    rates ``r_t(k) = emitted[t, k] / round_s[k]``,

        goodput = 1 / sum_t (mix_t / r_t(k_t)),

    which each type maximises at its own best k. :func:`batch_goodput` with ``batch_size = 1`` instead holds each
    type's share of the *rounds* fixed, pooling tokens over seconds: a type whose gain from drafting is below the
    pool's average rate (prose beside code that accepts well) is then turned off, though off makes that type
    slower and its requests take more rounds (``bench/results/vllm-61751bd-run2.json``: prose at batch 1 went off,
    at 1.0 token per 21 ms against 1.52 per 26 ms at k = 1).

    Args:
        emitted: ``[T, K + 1]`` expected emitted tokens per row for each type and k.
        mix: ``[T]`` each type's share of the tokens asked for (normalised here).
        round_s: ``[K + 1]`` expected seconds of a one-row round at each k.
        shared_k: force one k for every type.

    Returns:
        ``(combos [C, T] int, goodput [C])``, combos as :func:`batch_goodput` lists them.
    """
    n_types, n_k = emitted.shape
    w = np.asarray(mix, dtype=float)
    w = w / w.sum()
    combos = _combos(n_types, n_k, shared_k)
    rate = emitted / np.maximum(np.asarray(round_s, dtype=float), 1e-12)[None, :]  # [T, K+1] tokens per second
    inv = (w[None, :] / np.maximum(rate[np.arange(n_types)[None, :], combos], 1e-12)).sum(axis=1)  # [C] s per token
    return combos, 1.0 / inv


def slowest_type_seconds_per_token(combos: np.ndarray, emitted: np.ndarray, round_s: np.ndarray,
                                   present: np.ndarray, solo: bool = False) -> np.ndarray:
    """Seconds per emitted token of the slowest request type under each joint choice of k.

    A request's time per output token (TPOT) is the seconds of the rounds it shares over the tokens it emits in
    them, so the requests that accept least set the tail: they pay a round's seconds and keep few of its drafts.
    A round runs its largest k for every row (``solo``: rounds of one row, each type at its own k).

    Args:
        combos: ``[C, T]`` joint choices of k, one column per type.
        emitted: ``[T, K + 1]`` expected emitted tokens per row for each type and k.
        round_s: ``[K + 1]`` expected seconds of a round at each k.
        present: ``[T]`` bool, the types whose requests count; every type when none does.

    Returns:
        ``[C]`` the largest over the present types of ``round_s[k_round] / emitted[t, k_t]``.
    """
    n_types = emitted.shape[0]
    round_k = combos if solo else np.repeat(combos.max(axis=1, keepdims=True), n_types, axis=1)  # [C, T]
    per_token = np.asarray(round_s, dtype=float)[round_k] / np.maximum(
        emitted[np.arange(n_types)[None, :], combos], 1e-12)  # [C, T]
    mask = np.asarray(present, dtype=bool)
    if not mask.any():
        mask = np.ones(n_types, dtype=bool)
    return np.where(mask[None, :], per_token, 0.0).max(axis=1)


def tail_weighted(goodput: np.ndarray, slowest_s: np.ndarray, weight: float) -> np.ndarray:
    """Goodput times the slowest type's token rate relative to its best, to the power ``weight``.

    ``goodput * (min slowest_s / slowest_s) ** weight`` over the choices whose goodput is finite (a masked choice
    stays ``-inf``). 0 is goodput alone; 1 weighs a relative loss of the slowest type's rate like the same loss of
    goodput: the geometric mean of the batch's throughput and its slowest requests' speed, squared.

    Args:
        goodput: ``[C]`` expected goodput, ``-inf`` where a choice is not allowed.
        slowest_s: ``[C]`` :func:`slowest_type_seconds_per_token` of the same choices.
        weight: the exponent, >= 0.
    """
    ok = np.isfinite(goodput)
    if weight == 0.0 or not ok.any():
        return goodput
    best = float(slowest_s[ok].min())
    rel = best / np.maximum(slowest_s, 1e-30)  # [C] in (0, 1] on the allowed choices
    return np.where(ok, goodput * rel**weight, goodput)


def _combos(n_types: int, n_k: int, shared_k: bool) -> np.ndarray:
    """``[C, T]`` every joint per-type choice of k in ``0..n_k - 1``; one shared k per row when ``shared_k`` or when
    the grid would exceed ``MAX_JOINT_COMBOS``."""
    if shared_k or n_k**n_types > MAX_JOINT_COMBOS:
        return np.repeat(np.arange(n_k)[:, None], n_types, axis=1)
    return np.array(list(itertools.product(range(n_k), repeat=n_types)), dtype=int).reshape(-1, n_types)
