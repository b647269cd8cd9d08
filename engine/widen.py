"""Function-preserving widening of a trained decoder (Net2WiderNet, Chen, Goodfellow & Shlens 2016, arXiv 1511.05641).

Why: a real target is 20-100x its draft and, at high batch, compute-bound in its token-wise layers. The shipped
target (2.8M parameters) is only 7x the draft and never compute-bound on the machines this project runs on, so
one global k is as good as any policy. Widening the trained target by a factor ``r`` gives a model that computes
**the same function** (the same logits up to float rounding, so the same acceptance) while every forward does
the work of a larger model: ``r^2`` times the query, output and feed-forward projections, ``r`` times the
key/value projections (all of them ``r^2`` without ``share_kv``). It is a stand-in for a large target's cost,
not a better model: its predictions are target-v1's.

Construction (``x`` is the residual stream, ``[..., C]``; the widened stream is ``x' = [x, x, ..., x]``, r copies):
- every residual dimension is repeated ``r`` times (tiled), so the embedding's and every output projection's rows
  tile; RMS over ``x'`` equals RMS over ``x``, so RMSNorm weights tile as well;
- every query head is repeated ``r`` times, keeping the head dim (the rotary tables and the softmax scale are
  unchanged). The ``r`` copies of a head would have identical keys and values too, so by default they share one
  key/value head (``share_kv``): the widened model is grouped-query attention with the original heads as its
  key/value heads and ``r`` query heads per group, as Llama 2/3 and most served targets are. Its KV cache, and
  the KV read of every decode step, is the original model's per head, not ``r`` times it; with ``share_kv=False``
  the key/value heads are repeated as well (multi-head attention, ``r`` times the cache);
- every SwiGLU unit (gate and up alike) is repeated ``r`` times;
- the attention output then holds each head's output ``r`` times, in the widened head order ``wo`` reads;
- every input column that reads a repeated unit is divided by ``r``: the ``r`` copies sum to the original.
Dividing by a power of two is exact in floating point, so with ``r`` a power of two the widened weights hold the
original values exactly; only the order of the sums changes.
"""

from __future__ import annotations

import torch

from engine.model import ModelConfig, Transformer


def widened_config(cfg: ModelConfig, r: int, share_kv: bool = True) -> ModelConfig:
    """The shape of ``cfg`` widened ``r`` times: width, query heads and FFN times ``r``, head dim and depth
    unchanged; key/value heads as in ``cfg`` (``share_kv``) or times ``r``."""
    if r < 1:
        raise ValueError(f"widening factor must be >= 1, got {r}")
    if cfg.n_kv_heads is not None and cfg.n_kv_heads != cfg.n_heads:
        raise ValueError("widening starts from a multi-head model; this one already groups its key/value heads")
    return ModelConfig(
        n_layers=cfg.n_layers, d_model=cfg.d_model * r, n_heads=cfg.n_heads * r, ffn_hidden=cfg.ffn_hidden * r,
        max_seq_len=cfg.max_seq_len, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, vocab_size=cfg.vocab_size,
        n_kv_heads=cfg.n_heads if share_kv and r > 1 else None,
    )


def _tile_rows(w: torch.Tensor, r: int) -> torch.Tensor:
    """Output units repeated: ``[O, I] -> [r O, I]`` (or a vector ``[O] -> [r O]``)."""
    return w.repeat(r, *([1] * (w.dim() - 1)))


def _tile_cols(w: torch.Tensor, r: int) -> torch.Tensor:
    """Input columns that read a repeated unit: ``[O, I] -> [O, r I]``, divided by ``r`` so the copies sum back."""
    return w.repeat(1, r) / r


def widen_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig, r: int, share_kv: bool = True
) -> dict[str, torch.Tensor]:
    """Widen a :class:`~engine.model.Transformer` state dict ``r`` times (pure: the input is not modified).

    Layouts (``C`` width, ``H`` heads, ``D`` head dim, ``F`` FFN width):
        ``embed.weight [V, C]``, ``head.weight [V, C]``, ``*norm.weight [C]``,
        ``wqkv.weight [3 * H * D, C]`` (rows ordered q|k|v, then head, then dim),
        ``wo.weight [C, H * D]``, ``w13.weight [2F, C]`` (rows gate|up), ``w2.weight [C, F]``.
    With ``share_kv`` the widened query heads are ordered copy-minor (head ``j`` is original head ``j // r``,
    reading key/value head ``j // r``); without it copy-major (head ``j`` is original head ``j % H``).
    """
    out: dict[str, torch.Tensor] = {}
    h, d, f = cfg.n_heads, cfg.head_dim, cfg.ffn_hidden
    for name, w in state.items():
        if name == "embed.weight":  # [V, C] -> [V, rC]: the residual stream is tiled
            out[name] = w.repeat(1, r)
        elif name == "head.weight":  # reads the residual
            out[name] = _tile_cols(w, r)
        elif name.endswith("norm.weight"):  # RMS of the tiled stream is the RMS of the original
            out[name] = _tile_rows(w, r)
        elif name.endswith("wqkv.weight") and share_kv:  # q heads repeated in place, k and v kept: [(rH + 2H) D, rC]
            q, kv = w.view(3, h, d, -1)[0], w.view(3, h, d, -1)[1:]
            rows = torch.cat([q.repeat_interleave(r, dim=0).reshape(r * h * d, -1), kv.reshape(2 * h * d, -1)])
            out[name] = _tile_cols(rows, r)
        elif name.endswith("wqkv.weight"):  # heads repeated within each of q, k, v: [3, H, D, C] -> [3, rH, D, rC]
            w4 = w.view(3, h, d, -1).repeat(1, r, 1, 1)
            out[name] = _tile_cols(w4.reshape(3 * r * h * d, -1), r)
        elif name.endswith("wo.weight") and share_kv:  # reads head j // r's copies, writes the residual
            cols = w.view(w.shape[0], h, d).repeat_interleave(r, dim=1).reshape(w.shape[0], r * h * d) / r
            out[name] = _tile_rows(cols, r)
        elif name.endswith("wo.weight"):  # reads the repeated heads, writes the residual
            out[name] = _tile_rows(_tile_cols(w, r), r)
        elif name.endswith("w13.weight"):  # gate and up units repeated: [2, F, C] -> [2, rF, rC]
            w3 = w.view(2, f, -1).repeat(1, r, 1)
            out[name] = _tile_cols(w3.reshape(2 * r * f, -1), r)
        elif name.endswith("w2.weight"):  # reads the repeated units, writes the residual
            out[name] = _tile_rows(_tile_cols(w, r), r)
        else:
            raise ValueError(f"widen_state does not know how to widen parameter {name!r}")
    return out


@torch.no_grad()
def widen(model: Transformer, r: int, share_kv: bool = True) -> Transformer:
    """A new model, ``r`` times wider, computing the same function as ``model`` (see the module docstring)."""
    p = next(model.parameters())
    wide = Transformer(widened_config(model.cfg, r, share_kv))
    wide = wide.to(dtype=p.dtype)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    wide.load_state_dict(widen_state(state, model.cfg, r, share_kv))
    return wide.to(device=p.device, dtype=p.dtype).eval()
