"""spectune's models as HuggingFace Llama directories: names, shapes, tokenizer, and logits under transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.hf_export import llama_state, tokenizer_files, write_llama_dir
from engine.model import MODEL_PRESETS, Transformer

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("SPECTUNE_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python")))


def test_fused_projections_split_into_llama_names_and_back() -> None:
    torch.manual_seed(0)
    m = Transformer(MODEL_PRESETS["tiny-gqa"])  # 4 query heads over 2 key/value heads
    st = llama_state(m)
    cfg, own = m.cfg, m.state_dict()
    d = cfg.head_dim
    assert st["model.layers.0.self_attn.q_proj.weight"].shape == (cfg.n_heads * d, cfg.d_model)
    assert st["model.layers.0.self_attn.k_proj.weight"].shape == (cfg.kv_heads * d, cfg.d_model)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([st[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(qkv, own[f"layers.{i}.wqkv.weight"])
        gate_up = torch.cat([st[p + "mlp.gate_proj.weight"], st[p + "mlp.up_proj.weight"]])
        assert torch.equal(gate_up, own[f"layers.{i}.w13.weight"])
    assert torch.equal(st["lm_head.weight"], own["head.weight"])  # untied head
    assert len(st) == 3 + 9 * cfg.n_layers


def test_the_tokenizer_maps_each_byte_to_its_own_id() -> None:
    files = tokenizer_files()
    vocab = files["tokenizer.json"]["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(258))
    assert vocab["<s>"] == 256 and vocab["</s>"] == 257
    assert files["tokenizer_config.json"]["add_bos_token"] is True


def test_the_directory_says_what_it_holds(tmp_path: Path) -> None:
    m = Transformer(MODEL_PRESETS["tiny"])
    out = write_llama_dir(m, tmp_path / "tiny", {"what_it_is": "a random tiny model for a test"})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["spectune"]["what_it_is"] == "a random tiny model for a test"
    assert set(load_file(str(out / "model.safetensors"))) == set(llama_state(m))


def test_export_model_cli_writes_target_update_and_draft(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "controller.cli", "export-model", "--profile", "small",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft-v1", "target-v1", "target-v2"]
    info = json.loads((tmp_path / "target-v2" / "spectune.json").read_text())
    manifest = json.loads((REPO / "checkpoints" / "manifest.json").read_text())["checkpoints"]
    assert info["checkpoint_sha256"] == manifest["target-v2"]["sha256"] and info["role"] == "target"


CHECK = r"""
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from engine.checkpoint import profile_model
from engine.hf_export import export_profile
from engine.profiles import get_profile

out = Path(sys.argv[1])
text = "def f(x):\n    return {'k': x}  # é 日本\n"
res = {}
for prof in ("small", "xl"):
    models = export_profile(prof, out / prof)
    for m in models:
        tok = AutoTokenizer.from_pretrained(m.path)
        ids = tok(text)["input_ids"]
        res["tokenizer_ok"] = ids == [256, *text.encode()] and tok.decode(ids[1:]) == text
        info = json.loads((m.path / "spectune.json").read_text())
        ours = profile_model(get_profile(prof), info["checkpoint"])
        hf = AutoModelForCausalLM.from_pretrained(m.path, dtype=torch.float32).eval()
        x = torch.tensor([ids])
        with torch.no_grad():
            a, b = hf(x).logits, ours(x)
        res[f"{prof}/{m.name}"] = {"max_abs_diff": float((a - b).abs().max()),
                                   "argmax_equal": bool((a.argmax(-1) == b.argmax(-1)).all())}
print(json.dumps(res))
"""


@pytest.mark.slow
def test_transformers_computes_spectunes_logits(tmp_path: Path) -> None:
    """Every exported model, loaded by HF transformers (vLLM's environment), against spectune's own forward."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: run `make vllm`", pytrace=False)
    res = subprocess.run([str(VLLM_PYTHON), "-c", CHECK, str(tmp_path)], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got.pop("tokenizer_ok") is True
    assert sorted(got) == ["small/draft-v1", "small/target-v1", "small/target-v2", "xl/draft-v1",
                           "xl/target-v1-xl4", "xl/target-v2-xl4"]
    for name, r in got.items():
        assert r["argmax_equal"], name
        assert r["max_abs_diff"] < 1e-3, (name, r)  # about 2e-5 measured: float summation order only
