"""The exported HF Llama directories on a GPU: transformers' logits against spectune's forward, fp32 and bf16.

Run by ``bench/device_check.sh`` on a machine with a CUDA GPU and transformers (the GPU machines here have no vLLM,
so this is as close to "our models on a CUDA serving stack" as they allow). Usage: ``python bench/device_hf.py OUT``.
Prints one JSON line: per profile, model and dtype, the largest logit difference and whether the argmax agrees.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(out: Path) -> int:
    from transformers import AutoModelForCausalLM

    from engine.checkpoint import profile_model
    from engine.hf_export import export_profile
    from engine.profiles import get_profile

    text = "def f(x):\n    return {'k': x}  # a line of code, then prose: the quick brown fox.\n"
    ids = torch.tensor([[256, *text.encode()]], device="cuda")
    res: dict[str, dict[str, float | bool]] = {}
    for prof in ("small", "xl"):
        for m in export_profile(prof, out / prof):
            info = json.loads((m.path / "spectune.json").read_text())
            for dtype in (torch.float32, torch.bfloat16):
                ours = profile_model(get_profile(prof), info["checkpoint"], dtype=dtype).to("cuda")
                hf = AutoModelForCausalLM.from_pretrained(m.path, dtype=dtype).to("cuda").eval()
                with torch.no_grad():
                    a, b = hf(ids).logits.float(), ours(ids).float()  # [1, T, V]
                res[f"{prof}/{m.name}/{str(dtype).removeprefix('torch.')}"] = {
                    "max_abs_diff": round(float((a - b).abs().max()), 5),
                    "argmax_agree": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4),
                }
                del ours, hf
    print(json.dumps(res))
    worst = max(r["max_abs_diff"] for k, r in res.items() if k.endswith("float32"))
    print(f"fp32 worst logit difference {worst:.2e}; argmax agreement "
          f"{min(float(r['argmax_agree']) for r in res.values()):.4f} at worst (any dtype)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
