"""spectune inside vLLM: the policy table sets vLLM's per-step draft length, vLLM's steps become round records.

- :mod:`.steps` (no vLLM, no torch): the configuration, the rule that maps the table onto one k per batch, and
  the translation of a step's outcome into a :class:`~telemetry.records.RoundRecord`. Tested without vLLM.
- :mod:`.scheduler`: ``SpectuneScheduler``, a subclass of vLLM's v1 ``Scheduler`` for ``--scheduler-cls``. It
  imports vLLM and is imported by vLLM only.
- :mod:`.launch`: the ``vllm serve`` entry point run in vLLM's own virtual environment (``make vllm``).
- :mod:`.serve`: ``spectune vllm serve``, which exports the models when needed and starts :mod:`.launch`.
"""
