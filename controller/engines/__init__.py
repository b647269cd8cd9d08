"""Engine-side integrations for serving engines other than the reference one.

Each subpackage is code that runs *inside* another engine's process, like :mod:`controller.client`, and is
imported by that engine only (never by the rest of spectune): ``vllm/`` plugs into vLLM's scheduler.
"""
