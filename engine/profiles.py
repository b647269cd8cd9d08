"""The profiles: which target/draft pair runs. Torch-free, so CLIs and the simulator can name them.

- ``small``: the trained pair as shipped, target-v1 (2.8M parameters) and draft-v1 (0.40M, distilled from it).
- ``xl``: **a stand-in for a large target**, not a separately trained model. Its target is target-v1 widened
  four times function-preservingly (:mod:`engine.widen`): 6 layers x 768, 12 query heads of 64 sharing 3
  key/value heads (grouped-query attention, 4 query heads a group, as Llama 2/3 70B have 8), FFN 2048, 37.6M
  parameters, 94x the draft. It computes target-v1's function (largest logit difference about 3e-5 in fp32),
  so its acceptance is target-v1's, while every forward does the work of a 38M-parameter model: at high batch
  its token-wise layers become compute-bound, as a real target's do, and its KV cache per token is a grouped
  model's (a quarter of multi-head attention's), so a short-context decode step is not dominated by its KV
  read. Its version ids say so (``target-v1-xl4``: target-v1, widened 4x). It is built at load time
  (:func:`engine.checkpoint.build_target`); no widened weights are shipped.
The model update (target-v2) gets the same treatment in each profile.
"""

from __future__ import annotations

from dataclasses import dataclass

WIDEN_FACTOR_XL = 4  # target-v1 (6 x 192, 2.8M) -> 6 x 768, 12 query / 3 KV heads of 64, FFN 2048: 37.6M


@dataclass(frozen=True)
class Profile:
    """Which target/draft pair runs, and how its target is derived from the shipped checkpoint."""

    name: str
    widen: int  # 1 = the trained target as shipped; r > 1 = widened r times (same function, about r^2 the work)
    summary: str  # what the profile is, in one line, for manifests, reports and --help

    def target_version(self, checkpoint: str) -> str:
        """The version id of ``checkpoint`` in this profile: widened targets carry the factor in their name."""
        return checkpoint if self.widen == 1 else f"{checkpoint}-xl{self.widen}"


PROFILES: dict[str, Profile] = {
    "small": Profile("small", 1, "target-v1 (2.8M parameters, trained) with draft-v1 (0.40M, distilled from it)"),
    "xl": Profile(
        "xl",
        WIDEN_FACTOR_XL,
        "target-v1 widened 4x function-preservingly (Net2WiderNet, query heads repeated, key/value heads shared: "
        "grouped-query attention): a 37.6M-parameter stand-in for a large target with target-v1's exact "
        "predictions, so target-v1's acceptance at a 38M model's cost; draft-v1",
    ),
}
PROFILE_NAMES = tuple(PROFILES)
DEFAULT_PROFILE = "xl"  # the demo, `spectune engine` and `bench policies` run the physics of a large target
UNLABELLED_PROFILE = "small"  # a benchmark cell without a profile field measured the trained pair
PROFILE_HELP = "xl: target-v1 widened 4x (a 38M grouped-query model's cost, the same predictions); small: as trained"


def get_profile(name: str) -> Profile:
    """The profile called ``name``; a ValueError naming the choices otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}") from None
