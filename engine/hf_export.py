"""spectune's models as HuggingFace ``LlamaForCausalLM`` directories, for serving engines (vLLM, SGLang, HF).

The byte-level decoder of :mod:`engine.model` *is* a Llama: pre-norm RMSNorm, SwiGLU, untied head, and rotary
embeddings in the rotate-half convention (the first half of a head's dimensions paired with the second half),
which is HuggingFace Llama's own, so queries and keys need no permutation. Only the fused projections are split:

- ``wqkv.weight [(H + 2 Hkv) D, C]`` (rows q | k | v) -> ``q_proj [H D, C]``, ``k_proj [Hkv D, C]``,
  ``v_proj [Hkv D, C]``;
- ``w13.weight [2 F, C]`` (rows gate | up) -> ``gate_proj [F, C]``, ``up_proj [F, C]``; ``w2`` -> ``down_proj``.

The tokenizer is byte-level with ids equal to the bytes (0..255), BOS = 256 prepended to every prompt, EOS = 257:
a ByteLevel BPE with no merges, whose 256 base symbols are listed in byte order, so ``id == byte value``.

A directory says what it holds: ``spectune.json`` names the checkpoint, the profile and how the weights were made
(as trained, or widened function-preservingly), and ``config.json`` carries the same text in ``spectune``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.checkpoint import CHECKPOINT_DIR, DRAFT_V1, MANIFEST, TARGET_V1, TARGET_V2, profile_model
from engine.model import BOS_ID, EOS_ID, Transformer
from engine.profiles import Profile, get_profile

BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
EXPORT_FORMAT = 1  # bump when the directory layout changes


@dataclass(frozen=True)
class ExportedModel:
    """One exported directory."""

    name: str  # directory name under the export root, e.g. ``target-v1-xl4``
    path: Path
    version_id: str  # the version id spectune's telemetry uses for this model
    what_it_is: str


def llama_state(model: Transformer) -> dict[str, torch.Tensor]:
    """``model``'s weights under HuggingFace Llama's names (contiguous fp32 copies; the model is not modified)."""
    cfg = model.cfg
    h, hk, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    f = cfg.ffn_hidden
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": state["embed.weight"],
        "model.norm.weight": state["norm.weight"],
        "lm_head.weight": state["head.weight"],
    }
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        wqkv = state[src + "wqkv.weight"]  # [(H + 2 Hkv) D, C]
        w13 = state[src + "w13.weight"]  # [2F, C]
        out |= {
            dst + "self_attn.q_proj.weight": wqkv[: h * d],
            dst + "self_attn.k_proj.weight": wqkv[h * d : (h + hk) * d],
            dst + "self_attn.v_proj.weight": wqkv[(h + hk) * d :],
            dst + "self_attn.o_proj.weight": state[src + "wo.weight"],
            dst + "mlp.gate_proj.weight": w13[:f],
            dst + "mlp.up_proj.weight": w13[f:],
            dst + "mlp.down_proj.weight": state[src + "w2.weight"],
            dst + "input_layernorm.weight": state[src + "attn_norm.weight"],
            dst + "post_attention_layernorm.weight": state[src + "ffn_norm.weight"],
        }
    return {k: v.contiguous().clone() for k, v in out.items()}


def llama_config(model: Transformer, what_it_is: dict[str, Any]) -> dict[str, Any]:
    """HuggingFace ``LlamaConfig`` fields for ``model`` (fp32, untied head, byte vocabulary)."""
    cfg = model.cfg
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab_size,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
        "spectune": what_it_is,
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which HF's ByteLevel pre-tokenizer applies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def tokenizer_files() -> dict[str, dict[str, Any]]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` of the byte tokenizer."""
    symbols = _bytes_to_unicode()
    vocab = {symbols[b]: b for b in range(256)} | {BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}

    def special(token: str, token_id: int) -> dict[str, Any]:
        return {"id": token_id, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True}

    tokenizer: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [special(BOS_TOKEN, BOS_ID), special(EOS_TOKEN, EOS_ID)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [BOS_ID], "tokens": [BOS_TOKEN]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "added_tokens_decoder": {str(i): {k: v for k, v in special(t, i).items() if k != "id"}
                                 for t, i in ((BOS_TOKEN, BOS_ID), (EOS_TOKEN, EOS_ID))},
    }
    specials = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config, "special_tokens_map.json": specials}


def write_llama_dir(model: Transformer, out: Path, what_it_is: dict[str, Any]) -> Path:
    """Write ``model`` as a HuggingFace Llama directory: config, safetensors, tokenizer, and what it is."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(llama_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(llama_config(model, what_it_is), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "do_sample": False}, indent=2) + "\n")
    for name, body in tokenizer_files().items():
        (out / name).write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n")
    (out / "spectune.json").write_text(json.dumps(what_it_is, indent=2) + "\n")
    return out


def export_profile(profile: str | Profile, out_dir: Path, checkpoint_dir: Path = CHECKPOINT_DIR,
                   with_update: bool = True) -> list[ExportedModel]:
    """Export ``profile``'s target (target-v1), its model update (target-v2) and the draft (draft-v1).

    Directories are named by version id (``target-v1-xl4``, ``target-v2-xl4``, ``draft-v1`` in ``xl``), so the
    served model name and spectune's telemetry name the same thing.
    """
    prof = get_profile(profile) if isinstance(profile, str) else profile
    manifest = json.loads((checkpoint_dir / MANIFEST).read_text())["checkpoints"]
    done: list[ExportedModel] = []
    for name in (TARGET_V1, *((TARGET_V2,) if with_update else ()), DRAFT_V1):
        is_draft = name == DRAFT_V1
        model = profile_model(prof, name, checkpoint_dir)
        version = name if is_draft else prof.target_version(name)
        trained = manifest.get(name, {})
        if is_draft or prof.widen == 1:
            what = (f"{name}: spectune's byte-level model as trained on Python's standard library sources, its "
                    f"documentation and generated JSON records ({model.num_params():,} parameters)")
            construction = "as trained (`spectune train` reproduces it)"
        else:
            what = (f"{version}: {name} widened {prof.widen}x function-preservingly, a stand-in for a large "
                    f"target's cost with {name}'s predictions ({model.num_params():,} parameters)")
            construction = f"Net2WiderNet widening x{prof.widen} of {name} (engine/widen.py)"
        info = {
            "format": EXPORT_FORMAT,
            "version_id": version,
            "checkpoint": name,
            "profile": prof.name,
            "role": "draft" if is_draft else "target",
            "what_it_is": what,
            "construction": construction,
            "params": model.num_params(),
            "checkpoint_sha256": trained.get("sha256"),
            "tokenizer": "bytes: id = byte value (0..255), BOS 256 prepended, EOS 257",
        }
        path = write_llama_dir(model, out_dir / version, info)
        done.append(ExportedModel(version, path, version, what))
    return done
