"""Function-preserving widening (Net2WiderNet): same logits, r^2 the parameters, exact decoding on top of it."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import CHECKPOINT_DIR, DRAFT_V1, TARGET_V1, build_target, describe_profiles, load_checkpoint
from engine.loop import EngineConfig, Request, SpecEngine
from engine.model import MODEL_PRESETS, ModelConfig, Transformer
from engine.profiles import PROFILES, get_profile
from engine.widen import widen, widen_state, widened_config


@pytest.mark.parametrize("share_kv", [True, False])
@pytest.mark.parametrize("r", [2, 3, 4])
def test_widened_model_computes_the_same_function(r: int, share_kv: bool) -> None:
    torch.manual_seed(0)
    m = Transformer(MODEL_PRESETS["tiny"]).double().eval()
    wide = widen(m, r, share_kv=share_kv)
    assert wide.cfg.d_model == r * m.cfg.d_model and wide.cfg.head_dim == m.cfg.head_dim
    assert wide.cfg.n_heads == r * m.cfg.n_heads
    assert wide.cfg.kv_heads == (m.cfg.n_heads if share_kv else r * m.cfg.n_heads)

    def linear_params(model: Transformer) -> int:
        return sum(x.weight.numel() for x in model.layers.modules() if isinstance(x, torch.nn.Linear))

    c, n = m.cfg.d_model, m.cfg.n_layers
    kv_proj = n * 2 * c * c  # the key and value projections: r times wider input, r times more heads unless shared
    # The token-wise work of an r^2 larger model, but for the shared key/value heads' projections.
    assert linear_params(wide) == r * r * linear_params(m) - (r * r - r if share_kv else 0) * kv_proj
    assert wide.new_cache(2, 8).k[0].shape[1] == wide.cfg.kv_heads  # the cache holds key/value heads only
    toks = torch.randint(0, 258, (3, 40))
    with torch.no_grad():
        assert torch.allclose(wide(toks), m(toks), atol=1e-10)
        # The cached (packed, ragged) path agrees as well.
        c1, c2 = m.new_cache(3, 64), wide.new_cache(3, 64)
        lens = torch.tensor([40, 7, 19])
        a = m.forward_cached(toks, c1, real_lens=lens)
        b = wide.forward_cached(toks, c2, real_lens=lens)
    for i, n in enumerate(lens.tolist()):
        assert torch.allclose(a[i, :n], b[i, :n], atol=1e-6)


def test_widen_state_is_pure_and_rejects_unknown_parameters() -> None:
    m = Transformer(MODEL_PRESETS["tiny"])
    state = m.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    widen_state(state, m.cfg, 2)
    assert all(torch.equal(state[k], before[k]) for k in state)
    with pytest.raises(ValueError, match="bias"):
        widen_state({"layers.0.wqkv.bias": torch.zeros(3)}, m.cfg, 2)
    with pytest.raises(ValueError):
        widened_config(m.cfg, 0)
    with pytest.raises(ValueError, match="already groups"):
        widened_config(MODEL_PRESETS["tiny-gqa"], 2)
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_layers=1, d_model=32, n_heads=4, ffn_hidden=8, n_kv_heads=3)


@pytest.mark.slow
def test_xl_profile_is_target_v1_widened_4x_with_its_predictions() -> None:
    base = load_checkpoint(TARGET_V1)
    xl = build_target(get_profile("xl"), TARGET_V1, CHECKPOINT_DIR, torch.float32)
    shape = (xl.cfg.n_layers, xl.cfg.d_model, xl.cfg.n_heads, xl.cfg.kv_heads, xl.cfg.ffn_hidden)
    assert shape == (6, 768, 12, 3, 2048)
    assert 37e6 < xl.num_params() < 38e6
    toks = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = float((xl(toks) - base(toks)).abs().max())
    assert diff < 1e-3  # float rounding of a longer sum; measured about 3e-5
    assert get_profile("xl").target_version(TARGET_V1) == "target-v1-xl4"
    assert PROFILES["small"].target_version(TARGET_V1) == TARGET_V1
    entry = describe_profiles(base.cfg.to_dict())["target-v1-xl4"]
    assert entry["params"] == xl.num_params() and entry["derived_from"] == TARGET_V1
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("huge")


@pytest.mark.slow
def test_greedy_decoding_on_the_xl_target_equals_the_small_target() -> None:
    # Same function, so the same greedy output and the same acceptance with the shared draft.
    draft = load_checkpoint(DRAFT_V1)
    outs = []
    for name in ("small", "xl"):
        target = build_target(get_profile(name), TARGET_V1, CHECKPOINT_DIR, torch.float32)
        eng = SpecEngine(target, draft, EngineConfig(max_batch=2, max_context=128, k_max=4), name, "d")
        for j, p in enumerate([b"def main(", b'{"id": 3, "na']):
            assert eng.submit(Request(str(j), "code", p, 24, temperature=0.0, stop_at_eos=False))
        while not eng.idle():
            eng.step(lambda t, b, c: 3)
        outs.append(sorted((c.request_id, c.output) for c in eng.pop_finished()))
    assert outs[0] == outs[1]
