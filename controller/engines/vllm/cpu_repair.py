"""A repair of vLLM 0.32's CPU rejection sampler, applied by the launcher in every vLLM process.

**The fault.** On a CPU, vLLM replaces its Triton kernels with C++ ones (``CpuPlatform.
register_triton_kernel_overrides``). The replacement of ``rejection_sampler.expand_kernel`` (which spreads each
request's temperature, top-k and top-p over its draft tokens) converts the output tensor to an int64 *copy* and
writes there, so a float32 output is never written: ``expand_batch_to_tokens`` returns uninitialised memory (and
would truncate 0.7 to 0 if it were written). The rejection sampler then divides a sampled request's target
logits by that garbage, so with a draft model:

- drafts for requests with temperature > 0 are almost never accepted (measured with xl + draft-v1 at k = 3 and
  temperature 1: 0.005 accepted per draft token, against 0.54 that the two models' distributions give);
- the tokens it emits for them come from the garbage-tempered distribution, not the request's.

Greedy requests are untouched (they skip the expansion). Plain decoding is untouched (it does not expand).

**The repair.** The same expansion as the Triton kernel, in torch, for every dtype, writing into the output it
was given. It replaces ``vllm.utils.cpu_triton_utils._expand_kernel_impl`` before vLLM registers its overrides
(the launcher imports this module at module level, so vLLM's spawned engine and worker processes apply it too).
A vLLM without that attribute (a GPU build, another version) is left alone.
"""

from __future__ import annotations

from typing import Any

REPAIRED_ATTR = "_spectune_repaired"


def expand_to_tokens(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any, replace_to: Any,
                     MAX_NUM_TOKENS: Any = None) -> None:  # vLLM passes the kernel's keyword
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_to`` where it equals ``replace_from``), in place.

    Args:
        output: ``[num_tokens]`` any dtype; written in place (tokens past ``cu_num_tokens[-1]`` are left alone).
        input_val: ``[batch]`` same dtype as ``output``.
        cu_num_tokens: ``[batch]`` cumulative tokens per request.
    """
    import torch

    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)  # [batch]
    cu = cu_num_tokens.to(torch.int64)  # [batch]
    counts = torch.diff(cu, prepend=cu.new_zeros(1))  # [batch]
    n = int(cu[-1]) if cu.numel() else 0
    output[:n].copy_(torch.repeat_interleave(vals, counts))  # [n]


def apply() -> bool:
    """Install the repair in this process. True when vLLM's CPU override was there to replace."""
    try:
        from vllm.utils import cpu_triton_utils
    except Exception:  # no vLLM, or one without the CPU overrides: nothing to repair
        return False
    current = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if current is None:
        return False
    if getattr(current, REPAIRED_ATTR, False):
        return True
    setattr(expand_to_tokens, REPAIRED_ATTR, True)
    cpu_triton_utils._expand_kernel_impl = expand_to_tokens
    return True
