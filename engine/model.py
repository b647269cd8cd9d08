"""A small Llama-style byte-level decoder with a batched, preallocated KV cache.

Vocabulary: the 256 byte values, then BOS (256) and EOS (257). No tokenizer, so corpora from any machine work.

Architecture: pre-norm RMSNorm, rotary position embeddings, SwiGLU feed-forward, causal attention through
``torch.nn.functional.scaled_dot_product_attention``. The same module serves training (full sequences, no cache)
and decoding (several new tokens per row appended to a per-row cache in one forward). The projections are
:class:`engine.kernels.Linear`, which picks the faster CPU kernel for them at inference (:mod:`engine.kernels`).

The cache layout is ``[B, H, L, D]`` per layer, preallocated; each row has its own length. Appending writes at
``lengths[b] + t``; rolling back is resetting ``lengths[b]`` (no copies, stale entries are masked out and
overwritten later).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import Linear

BYTE_VOCAB = 256
BOS_ID = 256  # start of every document and every prompt
EOS_ID = 257  # end of a document; decoding a row stops when it is emitted
VOCAB_SIZE = 258


@dataclass(frozen=True)
class ModelConfig:
    """Shape of one decoder. Presets live in ``MODEL_PRESETS``."""

    n_layers: int  # depth; at batch 1 on any device per-forward cost grows with depth, not width
    d_model: int  # residual width
    n_heads: int  # attention (query) heads; d_model must divide evenly
    ffn_hidden: int  # SwiGLU hidden width (about 8/3 d_model in Llama)
    max_seq_len: int = 2048  # rotary table length and the largest cache a request may use
    rope_theta: float = 10000.0  # rotary base, as in Llama
    norm_eps: float = 1e-5  # RMSNorm epsilon
    vocab_size: int = VOCAB_SIZE  # bytes + BOS + EOS
    # Key/value heads (grouped-query attention, Ainslie et al. 2023): query head h reads key/value head
    # h // (n_heads / n_kv_heads), as in Llama 2/3. None: one per query head (multi-head attention).
    n_kv_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dimension must be even for rotary embeddings")
        if self.vocab_size != VOCAB_SIZE:
            raise ValueError(f"the byte vocabulary has {VOCAB_SIZE} entries, got vocab_size={self.vocab_size}")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must be positive and divide n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: what the cache stores per layer and position."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def to_dict(self) -> dict[str, int | float]:
        # Multi-head configs keep the fields they had before grouped-query attention (manifests stay as shipped).
        return {k: v for k, v in asdict(self).items() if v is not None}


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Deep and narrow: enough depth that one forward costs clearly more than the draft's, small enough to see
    # tens of millions of bytes in an hour on two CPU cores.
    "target": ModelConfig(n_layers=6, d_model=192, n_heads=3, ffn_hidden=512),
    # One wide-enough layer: a forward costs a small fraction of the target's, distilled to agree with it.
    "draft": ModelConfig(n_layers=1, d_model=160, n_heads=2, ffn_hidden=448),
    # Tiny shapes for unit tests (random weights are fine for exactness tests).
    "tiny": ModelConfig(n_layers=2, d_model=32, n_heads=2, ffn_hidden=64, max_seq_len=512),
    # ... and with grouped-query attention: 4 query heads over 2 key/value heads.
    "tiny-gqa": ModelConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=96, max_seq_len=512, n_kv_heads=2),
}


class KVCache:
    """Preallocated per-layer key/value cache for a batch of rows with independent lengths.

    Attributes:
        k, v: lists of ``[B, Hkv, L, D]`` tensors, one per layer (``Hkv``: key/value heads).
        lengths: ``[B]`` int64 on the CPU — the number of valid positions of each row. Kept on the host so that
            slicing and capacity checks never synchronise with the device.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (batch_size, n_kv_heads, capacity + 1, head_dim)  # the last slot is scratch for padding writes
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.capacity = capacity
        self.batch_size = batch_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset_row(self, row: int) -> None:
        self.lengths[row] = 0

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange rows ``a`` and ``b`` (their cached positions and lengths): a row's slot is not its identity."""
        n = int(max(self.lengths[a], self.lengths[b]))
        if a != b and n > 0:
            for t in self.k + self.v:
                t[[a, b], :, :n] = t[[b, a], :, :n]  # the right side is a copy: a true exchange
        self.lengths[[a, b]] = self.lengths[[b, a]]

    def rollback(self, row: int, length: int) -> None:
        """Truncate a row to ``length`` positions (stale entries are masked and later overwritten)."""
        if not 0 <= length <= int(self.lengths[row]):
            raise ValueError(f"cannot roll row {row} back to {length}; it holds {int(self.lengths[row])}")
        self.lengths[row] = length


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


# Decode-time application of a submodule without nn.Module.__call__ (its hook machinery costs about 2 us a call,
# a visible share of a draft step that is some twenty small kernels).
_lin = Linear.forward
_norm = RMSNorm.forward


def rope_table(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables in the form :func:`apply_rope` takes, for pairs (first half, second half) of a head.

    Returns:
        cos: ``[max_len, head_dim]`` float32, ``cat(cos, cos)`` of each position's angles.
        sin: ``[max_len, head_dim]`` float32, ``cat(-sin, sin)``: the sign of the rotation is folded in.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)  # [max_len, D/2]
    cos, sin = ang.cos(), ang.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dimension: ``(x1, x2) -> (x1 c - x2 s, x2 c + x1 s)``.

    Written as ``x * cos + roll(x, D/2) * sin`` with the tables of :func:`rope_table`: three kernels instead of the
    eight of chunk / four products / sum / difference / cat. A decode step of the one-layer draft is mostly
    per-kernel overhead, so this is measurable there.

    Args:
        x: ``[..., B, H, T, D]`` (queries and keys may be stacked in front).
        cos, sin: ``[B, 1, T, D]`` gathered at each token's absolute position.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention of ``H`` query heads over ``Hkv`` key/value heads, query head ``h`` reading ``h // (H / Hkv)``.

    A decode step (one query a row) folds each key/value head's ``g = H / Hkv`` query heads into ``g`` queries of
    one head, so every cached key is read once per key/value head (measured 4 ms a layer for 12 separate heads
    over batch 64 x 200 positions, 1 ms for 3 heads of 4 queries); longer windows use the kernel's own grouping.

    Args:
        q: ``[R, H, T, D]``.
        k, v: ``[R, Hkv, L, D]``.
        mask: additive, broadcastable to ``[R, 1, T, L]``, or None.
    Returns:
        ``[R, H, T, D]``.
    """
    r, h, t, d = q.shape
    hk = k.shape[1]
    if hk == h:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if t == 1:
        g = h // hk
        folded_mask = None if mask is None else mask.expand(-1, -1, g, -1)  # [R, 1, g, L]: a view
        y = F.scaled_dot_product_attention(q.reshape(r, hk, g, d), k, v, attn_mask=folded_mask)  # [R, Hkv, g, D]
        return y.reshape(r, h, 1, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


MAX_ATTENTION_GROUPS = 8  # more runs than this: one padded attention (gathering the rows' keys when scattered)


@dataclass(frozen=True)
class AttentionGroup:
    """Rows ``lo..hi-1`` of a forward (positions in its row order) that sit in consecutive cache rows from
    ``slot`` and each append ``t`` tokens; the longest of them holds ``end`` positions afterwards."""

    lo: int
    hi: int
    slot: int
    t: int
    end: int


def attention_groups(slots: list[int], real_lens: list[int], new_lens: list[int]) -> tuple[AttentionGroup, ...] | None:
    """Split a forward's rows into runs of consecutive cache rows with equal new-token counts.

    Each run attends over a view of its cache rows (no gather) with its queries padded to its own count only.
    None when one run covers every row in consecutive cache rows (the single attention is the same), or when
    there are more than ``MAX_ATTENTION_GROUPS`` runs: each run is one more attention call per layer, and rows
    of many lengths interleaved (a prefill of ragged prompts) gain little from splitting.

    Args:
        slots: each row's cache row, in the forward's row order.
        real_lens: new tokens of each row.
        new_lens: each row's length after the forward.
    """
    runs: list[AttentionGroup] = []
    lo = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or real_lens[i] != real_lens[lo] or slots[i] != slots[i - 1] + 1:
            runs.append(AttentionGroup(lo, i, slots[lo], real_lens[lo], max(new_lens[lo:i])))
            lo = i
    if len(runs) == 1 or len(runs) > MAX_ATTENTION_GROUPS:
        return None
    return tuple(runs)


@dataclass(frozen=True)
class CachedAttention:
    """What every layer of one cached forward shares: positions, mask, cache write offsets, packing.

    Token-wise work (projections, MLP) runs on the ``N`` real tokens only (packed verification, as in a
    flattened-batch engine). Attention runs in a padded per-row ``[R, H, T, D]`` layout, once per **group**: a
    run of rows in consecutive cache rows with the same number of new tokens, over a view of those cache rows,
    padded to that number, not to the batch's ``T`` (see :func:`attention_groups`). Padded queries are not free:
    at batch 64 on the CPU, 9 queries a row instead of 3 cost the xl target's attention 25-30% more at 300
    cached positions (measured), so a batch whose structured rows draft 8 while code rows draft 2 would pay for
    9 queries on every row; and a gather of scattered rows' keys copies them before reading them.
    """

    cos: torch.Tensor  # [R, 1, T, D] rotary tables at each token's absolute position (see rope_table)
    sin: torch.Tensor  # [R, 1, T, D]
    mask: torch.Tensor | None  # [R, 1, T, end] additive float mask (0 visible, -inf hidden); None: all visible
    rows: torch.Tensor  # [R, 1] cache rows on the device
    flat: torch.Tensor  # [R * Hkv * T] offsets of the new keys/values in the cache viewed [B * Hkv * L', D]
    attend_len: int  # keys 0..attend_len-1 are read (the longest row after this forward)
    row_span: tuple[int, int] | None  # (lo, hi) when the rows are a contiguous range of the cache: a view
    padded_shape: tuple[int, int]  # (R, T)
    real: torch.Tensor | None  # [N] flat indices of the real tokens in R * T; None when no row is padded
    groups: tuple[AttentionGroup, ...] | None = None  # None: one attention over every row, padded to T

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, C]`` real tokens -> ``[R, T, C]`` with zeros at padding."""
        r, t = self.padded_shape
        if self.real is None:
            return x.view(r, t, x.shape[-1])
        out = x.new_zeros(r * t, x.shape[-1])
        out.index_copy_(0, self.real, x)
        return out.view(r, t, x.shape[-1])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, T, C]`` -> ``[N, C]``, the real tokens in row-major order."""
        flat = x.reshape(-1, x.shape[-1])
        return flat if self.real is None else flat.index_select(0, self.real)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # Rows q (H heads) | k (Hkv) | v (Hkv), each head's D rows together: [(H + 2 Hkv) D, C].
        self.wqkv = Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.wo = Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.w13 = Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)  # gate and up fused: one matmul
        self.w2 = Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """Residual SwiGLU feed-forward (submodules through ``forward``, see :meth:`forward_cached`)."""
        gate, up = _lin(self.w13, _norm(self.ffn_norm, x)).chunk(2, dim=-1)
        return x + _lin(self.w2, F.silu(gate) * up)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training forward: causal attention over whole sequences.

        Args:
            x: ``[B, T, C]``.
            cos, sin: ``[1, 1, T, D]``.
        """
        b, t, c = x.shape
        q, k, v = self._qkv(self.wqkv(self.attn_norm(x)), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self._mlp(x + self.wo(y.transpose(1, 2).reshape(b, t, c)))

    def _qkv(
        self, proj: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split ``wqkv``'s output ``[R, T, (H + 2 Hkv) D]`` into rotated queries ``[R, H, T, D]``, rotated keys
        and values ``[R, Hkv, T, D]``."""
        h, hk, d = self.n_heads, self.n_kv_heads, self.head_dim
        r, t = proj.shape[:2]
        qkv = proj.view(r, t, h + 2 * hk, d).transpose(1, 2)  # [R, H + 2 Hkv, T, D]
        if hk == h:  # one rotation for queries and keys together
            qk = apply_rope(qkv[:, : 2 * h], cos, sin)
            return qk[:, :h], qk[:, h:], qkv[:, 2 * h :]
        return apply_rope(qkv[:, :h], cos, sin), apply_rope(qkv[:, h : h + hk], cos, sin), qkv[:, h + hk :]

    def forward_cached(
        self, x: torch.Tensor, ctx: CachedAttention, cache_kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Decode-time forward over packed tokens, appending their keys and values to the cache.

        Submodules are applied through their ``forward`` (:func:`_norm`, :func:`_lin`), not ``__call__``: no
        hooks are used at decode time, and a step of the one-layer draft is mostly per-call overhead on the CPU.

        Args:
            x: ``[N, C]`` the real tokens of the forward, packed.
        Returns:
            ``[N, C]``.
        """
        c = x.shape[-1]
        r, t = ctx.padded_shape
        # Projections on the real tokens only, then the padded [R, T] layout attention uses.
        q, k, v = self._qkv(ctx.unpack(_lin(self.wqkv, _norm(self.attn_norm, x))), ctx.cos, ctx.sin)
        ck, cv = cache_kv
        # index_copy_ on a flat view is far cheaper than advanced-index assignment (one memcpy per vector).
        ck.view(-1, self.head_dim).index_copy_(0, ctx.flat, k.reshape(-1, self.head_dim))
        cv.view(-1, self.head_dim).index_copy_(0, ctx.flat, v.reshape(-1, self.head_dim))
        if ctx.groups is None:
            if ctx.row_span is not None:  # the rows are a contiguous range of the cache: a view, no copy
                lo, hi = ctx.row_span
                k, v = ck[lo:hi, :, : ctx.attend_len], cv[lo:hi, :, : ctx.attend_len]
            else:  # scattered rows in many runs: gather only the used prefix
                k, v = ck[ctx.rows[:, 0], :, : ctx.attend_len], cv[ctx.rows[:, 0], :, : ctx.attend_len]
            y = grouped_attention(q, k, v, ctx.mask)  # [R, H, T, D]
            y_rt = y.transpose(1, 2).reshape(r, t, c)
        else:  # one attention per run, over a view of its cache rows, padded to its own token count only
            y_rt = x.new_zeros(r, t, c)
            for g in ctx.groups:
                n = g.hi - g.lo
                rows = slice(g.slot, g.slot + n)
                mask = None if ctx.mask is None else ctx.mask[g.lo : g.hi, :, : g.t, : g.end]
                y = grouped_attention(  # [n, H, t, D]
                    q[g.lo : g.hi, :, : g.t], ck[rows, :, : g.end], cv[rows, :, : g.end], mask
                )
                y_rt[g.lo : g.hi, : g.t] = y.transpose(1, 2).reshape(n, g.t, c)
        return self._mlp(x + _lin(self.wo, ctx.pack(y_rt)))  # attention output packed to [N, C]


class Transformer(nn.Module):
    """Byte-level Llama-style decoder."""

    rope_cos: torch.Tensor  # [max_seq_len, head_dim] buffers, not parameters (see rope_table)
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def prepare_inference(self) -> Transformer:
        """Switch to eval mode and pre-pack weights for the fastest CPU kernels (:mod:`engine.kernels`)."""
        self.eval()
        footprint = self.weight_bytes()
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack(footprint)
        return self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def kv_cache_bytes(self, batch_size: int, capacity: int) -> int:
        """What :meth:`new_cache` would allocate, without allocating it (capacity + 1 slots: one is scratch)."""
        p = next(self.parameters())
        per_layer = 2 * batch_size * self.cfg.kv_heads * (capacity + 1) * self.cfg.head_dim * p.element_size()
        return self.cfg.n_layers * per_layer

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        if capacity > self.cfg.max_seq_len:  # rotary table bounds the positions a row may reach
            raise ValueError(f"cache capacity {capacity} exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        p = next(self.parameters())
        return KVCache(
            self.cfg.n_layers, batch_size, self.cfg.kv_heads, capacity, self.cfg.head_dim, p.device, p.dtype
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Training forward over whole sequences (no cache).

        Args:
            tokens: ``[B, T]`` int64.
        Returns:
            logits: ``[B, T, V]``.
        """
        t = tokens.shape[1]
        cos = self.rope_cos[:t].to(self.embed.weight.dtype)[None, None]
        sin = self.rope_sin[:t].to(self.embed.weight.dtype)[None, None]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))

    def forward_cached(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        rows: torch.Tensor | None = None,
        real_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append up to ``T`` tokens per row to the cache and return their logits (ragged rows, packed work).

        Row ``r`` appends ``real_lens[r]`` tokens at positions ``cache.lengths[r] + t``; its remaining
        ``T - real_lens[r]`` entries are padding. The embedding, every projection, the MLP and the head run on
        the ``sum(real_lens)`` real tokens only, so a row with fewer tokens costs less (packed verification);
        attention runs in a padded per-row layout, where padding keys go to the cache's scratch slot (never
        attended to by a real query). Afterwards each row's length grows by its real length.

        Args:
            tokens: ``[R, T]`` int64 on the model's device.
            cache: the model's cache; ``rows`` index into its batch dimension.
            rows: ``[R]`` int64 CPU row indices, or None for all rows in order.
            real_lens: ``[R]`` int64 CPU, ``1..T``; None means every row appends ``T``.
        Returns:
            logits: ``[R, T, V]`` float32; zeros at padding.
        Raises:
            CacheCapacityError: a row would grow past the cache.
        """
        dev = tokens.device
        r, t = tokens.shape
        if rows is None:
            rows = torch.arange(cache.batch_size)
        rows_l = rows.tolist()
        lo = rows_l[0]
        span = (lo, lo + r) if rows_l == list(range(lo, lo + r)) else None  # contiguous rows: a view of the cache
        if t == 1:
            ctx, new_lens = self._one_token_context(cache, rows, rows_l, span, dev)
            x = self.embed(tokens[:, 0])  # [R, C]: one token a row, nothing to pack
        else:
            ctx, new_lens = self._ragged_context(cache, rows, span, real_lens, t, dev)
            x = self.embed(ctx.pack(tokens[:, :, None])[:, 0])  # [N, C]
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Block)
            x = layer.forward_cached(x, ctx, (cache.k[i], cache.v[i]))
        if span is not None:
            cache.lengths[span[0] : span[1]] = new_lens  # a slice copy, not an index_put
        else:
            cache.lengths[rows] = new_lens
        return ctx.unpack(_lin(self.head, _norm(self.norm, x)).float())

    def _one_token_context(
        self,
        cache: KVCache,
        rows: torch.Tensor,
        rows_l: list[int],
        span: tuple[int, int] | None,
        dev: torch.device,
    ) -> tuple[CachedAttention, torch.Tensor]:
        """The attention context of a decode step: one new token per row, no padding.

        The same context :meth:`_ragged_context` builds for ``T = 1``, in a fraction of the kernels: a draft
        step of the one-layer draft costs little more than its kernel launches (about 6 us each on the CPU), so
        the set-up is a visible share. Small index arithmetic is done on Python ints, and contiguous rows are
        read as slices.

        Args:
            rows: ``[R]`` int64 CPU; ``rows_l`` the same as a list.
        Returns:
            the context, and the rows' lengths after the step (``[R]`` CPU).
        """
        starts = cache.lengths[rows] if span is None else cache.lengths[span[0] : span[1]]  # [R] CPU
        starts_l = starts.tolist()  # each row's new token goes to position starts_l[r]
        end = max(starts_l) + 1
        _check_capacity(end, cache)
        dtype = self.embed.weight.dtype
        mask = None
        if min(starts_l) != end - 1:  # rows of different lengths: hide each row's keys past its own position
            visible = torch.arange(end)[None, :] <= starts[:, None]  # [R, end]
            mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
            mask = mask.to(dev, non_blocking=True)[:, None, None]  # [R, 1, 1, end]
        n_h, slots = self.cfg.kv_heads, cache.capacity + 1
        # Offsets of the new keys in the cache viewed [B * Hkv * L', D]: row-major over (row, key/value head).
        flat = torch.tensor(
            [(row * n_h + h) * slots + s for row, s in zip(rows_l, starts_l, strict=True) for h in range(n_h)]
        )
        pos = starts.to(dev, non_blocking=True)
        ctx = CachedAttention(
            cos=self.rope_cos[pos].to(dtype)[:, None, None],
            sin=self.rope_sin[pos].to(dtype)[:, None, None],
            mask=mask,
            rows=rows.to(dev)[:, None],
            flat=flat.to(dev, non_blocking=True),
            attend_len=end,
            row_span=span,
            padded_shape=(len(rows_l), 1),
            real=None,
            # Scattered rows (a draft step of the rows still drafting): one attention per run of consecutive
            # cache rows, each over a view, rather than a gather of every row's keys.
            groups=None if span is not None else attention_groups(rows_l, [1] * len(rows_l), [n + 1 for n in starts_l]),
        )
        return ctx, starts + 1

    def _ragged_context(
        self,
        cache: KVCache,
        rows: torch.Tensor,
        span: tuple[int, int] | None,
        real_lens: torch.Tensor | None,
        t: int,
        dev: torch.device,
    ) -> tuple[CachedAttention, torch.Tensor]:
        """The attention context of a forward appending up to ``t`` tokens per row (see :meth:`forward_cached`).

        Returns:
            the context, and the rows' lengths after the forward (``[R]`` CPU).
        """
        r = rows.shape[0]
        if real_lens is None:
            real_lens = torch.full((r,), t, dtype=torch.long)
        starts = cache.lengths[rows]  # [R] CPU
        new_lens = starts + real_lens
        end = int(new_lens.max())
        _check_capacity(end, cache)
        steps = torch.arange(t)[None, :]  # [1, T]
        pos_cpu = starts[:, None] + steps  # [R, T]
        pad = steps >= real_lens[:, None]  # [R, T]
        write_cpu = pos_cpu.masked_fill(pad, cache.capacity)  # padding writes land in the scratch slot
        rope_pos = pos_cpu.clamp(max=self.cfg.max_seq_len - 1)
        dtype = self.embed.weight.dtype
        rp = rope_pos.to(dev, non_blocking=True)
        mask = None
        if t > 1 or bool((new_lens != end).any()):
            # Key j is visible to query (r, i) iff j <= pos[r, i]: the cached prefix plus causality within the
            # new tokens. Padding queries sit at the scratch index; their outputs are discarded. (One new token
            # per row with every row ending at ``end`` sees every key: no mask, the common decode step.)
            pos = write_cpu.to(dev, non_blocking=True)  # [R, T] cache slot of each new token
            key_pos = torch.arange(end, device=dev)
            visible = key_pos[None, None, :] <= pos[:, :, None]  # [R, T, end]
            # An additive float mask: CPU SDPA kernels run it markedly faster than a boolean one at decode shapes.
            mask = torch.zeros(visible.shape, dtype=dtype, device=dev).masked_fill_(~visible, float("-inf"))[:, None]
        # Flat write offsets into the cache viewed as [B * Hkv * (capacity + 1), D], shared by every layer.
        n_h, slots = self.cfg.kv_heads, cache.capacity + 1
        heads = torch.arange(n_h)[None, :, None]  # [1, Hkv, 1]
        flat_cpu = (rows[:, None, None] * n_h + heads) * slots + write_cpu[:, None, :]  # [R, Hkv, T]
        real = None
        if bool(pad.any()):
            real = (~pad).reshape(-1).nonzero()[:, 0].to(dev, non_blocking=True)  # [N]
        groups = None  # one padded attention over a view when the rows are contiguous and none is padded
        if span is None or real is not None:
            groups = attention_groups(rows.tolist(), real_lens.tolist(), new_lens.tolist())
        ctx = CachedAttention(
            cos=self.rope_cos[rp].to(dtype)[:, None],
            sin=self.rope_sin[rp].to(dtype)[:, None],
            mask=mask,
            rows=rows.to(dev)[:, None],
            flat=flat_cpu.reshape(-1).to(dev, non_blocking=True),
            attend_len=end,
            row_span=span,
            padded_shape=(r, t),
            real=real,
            groups=groups,
        )
        return ctx, new_lens


class CacheCapacityError(ValueError):
    """A request would grow past the preallocated cache."""


def _check_capacity(end: int, cache: KVCache) -> None:
    """Refuse a forward after which a row would hold ``end`` positions, more than ``cache`` has."""
    if end > cache.capacity:
        raise CacheCapacityError(
            f"a row would reach {end} positions but the cache holds {cache.capacity}; "
            "raise the engine's max_context or shorten the request"
        )
