"""The repair of vLLM 0.32's CPU rejection sampler (``controller/engines/vllm/cpu_repair.py``), in vLLM's own
environment: the expansion it installs spreads each request's sampling parameter over its draft tokens exactly,
where vLLM's CPU override leaves a float output unwritten."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import torch
import controller.engines.vllm.launch  # the version repair vLLM's platform detection needs
from vllm.platforms import current_platform
from vllm.v1.sample import rejection_sampler as rs
from controller.engines.vllm import cpu_repair

current_platform.import_kernels()
installed = cpu_repair.apply()
current_platform.register_triton_kernel_overrides()
cu = torch.tensor([3, 3, 5], dtype=torch.int32)  # request 1 has no draft tokens this step
out = {"installed": installed}
for name, x in (("float32", torch.tensor([1.0, 0.5, 0.0])), ("int32", torch.tensor([7, 9, 0], dtype=torch.int32)),
                ("int64", torch.tensor([7, 9, 0], dtype=torch.int64))):
    out[name] = rs.expand_batch_to_tokens(x, cu, 5, replace_from=0, replace_to=1).tolist()
print(json.dumps(out))
"""


def test_the_repaired_expansion_is_exact_for_every_dtype(vllm_python: Path) -> None:
    run = subprocess.run([str(vllm_python), "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["installed"] is True  # vLLM 0.32's CPU build has the faulty override to replace
    assert got["float32"] == [1.0, 1.0, 1.0, 1.0, 1.0]  # temperature 0 (greedy) stands for 1, as in the kernel
    assert got["int32"] == got["int64"] == [7, 7, 7, 1, 1]


def test_the_expansion_in_torch_matches_the_kernels_rule() -> None:
    import torch

    from controller.engines.vllm.cpu_repair import expand_to_tokens

    out = torch.full((6,), -1.0)
    expand_to_tokens(out, torch.tensor([0.7, 0.0, 1.3]), torch.tensor([2, 3, 5]), 0, 1)
    assert out.tolist() == [0.699999988079071, 0.699999988079071, 1.0, 1.2999999523162842, 1.2999999523162842, -1.0]
