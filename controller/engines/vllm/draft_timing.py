"""The draft's proposal time, measured in vLLM's worker and carried to the scheduler with the step's output.

**Why.** One vLLM step does two jobs in one worker call: the target verifies the drafts proposed in the step
before, and the drafter proposes the next step's drafts. The scheduler sees only the sum. When k changes from one
step to the next (a policy at work: cells, batch sizes and request mixes change every few steps), a step that
verifies k = 3 drafts but proposes k = 5 is timed as a k = 3 round carrying a k = 5 proposal, and the other way
round. Every k is then charged for the average proposal of its neighbours: the cost differences between ks flatten
and deep k looks cheaper than it is. On the 2-core VM the proposal is a large part of a step: the draft's passes add
about 5 ms per drafted position to a 41 ms batch-1 step (measured with this module's trace: batch-1 decode steps
of 41, 57 and 72 ms at a fixed k of 0, 3 and 5).

**What this does** (installed by :mod:`controller.engines.vllm.launch` in vLLM's processes). It times the model
runner's ``propose_draft_token_ids`` (the draft's whole work for the step: a lazy-sync catch-up included) and puts
the seconds on the step's ``ModelRunnerOutput`` as ``spectune_propose_s``; the output travels to the scheduler
process pickled, attributes and all. :class:`~controller.engines.vllm.steps.VllmStepBridge` then charges each
round with the proposal that made the drafts it verifies (the step before's) and takes this step's proposal out
of its verification time.

On CUDA the drafter's kernels run asynchronously, so the timer waits for the device at the end of the proposal;
in the synchronous scheduling spectune's scheduler needs, the engine waits for the drafts right after the step
anyway (``take_draft_token_ids``).
"""

from __future__ import annotations

import time
from typing import Any

ATTR = "spectune_propose_s"  # seconds of the step's draft proposal, on vLLM's ModelRunnerOutput
_PATCHED = "_spectune_draft_timing"


def propose_seconds(model_runner_output: Any) -> float | None:
    """The proposal seconds a step's output carries (None: not measured, e.g. a vLLM without this module)."""
    v = getattr(model_runner_output, ATTR, None)
    return float(v) if isinstance(v, int | float) and v >= 0.0 else None


def apply() -> bool:
    """Install the timer in this process (when vLLM is importable). True when installed."""
    try:
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # no vLLM here: nothing to install
        return False
    if getattr(GPUModelRunner, _PATCHED, False):
        return True
    import torch

    runner_propose = GPUModelRunner.propose_draft_token_ids
    runner_sample = GPUModelRunner.sample_tokens

    def propose_draft_token_ids(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return runner_propose(self, *args, **kwargs)
        finally:
            dev = getattr(self, "device", None)
            if getattr(dev, "type", None) == "cuda":
                torch.cuda.synchronize(dev)
            self._spectune_propose_s = getattr(self, "_spectune_propose_s", 0.0) + time.perf_counter() - t0

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._spectune_propose_s = 0.0
        out = runner_sample(self, *args, **kwargs)
        if isinstance(out, ModelRunnerOutput):
            setattr(out, ATTR, self._spectune_propose_s)
        return out

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner.sample_tokens = sample_tokens
    setattr(GPUModelRunner, _PATCHED, True)
    return True
