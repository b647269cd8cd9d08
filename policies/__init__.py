"""Policies: pure learning logic that decides k (0 = speculation off) per bucket. One policy per file.

``REGISTRY`` maps each policy's name to its class; the conformance suite runs every entry.
"""

from policies.base import Decision, DecisionKind, Policy
from policies.batch_table import BatchTablePolicy
from policies.goodput import GoodputPolicy
from policies.hf_heuristic import HFHeuristicPolicy
from policies.sglang_adaptive import SGLangAdaptiveBSPolicy, SGLangAdaptivePolicy
from policies.static import StaticPolicy
from policies.trtllm_schedule import TRTLLMSchedulePolicy
from policies.ucb import UCBPolicy
from policies.vllm_dynamic import VLLMDynamicPolicy

REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (StaticPolicy, BatchTablePolicy, TRTLLMSchedulePolicy, HFHeuristicPolicy, SGLangAdaptivePolicy,
                SGLangAdaptiveBSPolicy, VLLMDynamicPolicy, UCBPolicy, GoodputPolicy)
}

__all__ = [
    "REGISTRY",
    "BatchTablePolicy",
    "Decision",
    "DecisionKind",
    "GoodputPolicy",
    "HFHeuristicPolicy",
    "Policy",
    "SGLangAdaptiveBSPolicy",
    "SGLangAdaptivePolicy",
    "StaticPolicy",
    "TRTLLMSchedulePolicy",
    "UCBPolicy",
    "VLLMDynamicPolicy",
]
