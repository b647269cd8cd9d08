"""spectune's control loop: what turns telemetry into a policy table and a table into each row's k.

Grouped by who runs it:

- :mod:`controller.client`: what an engine embeds (no torch). :class:`~controller.client.PolicyClient` answers
  ``decide(request_type, batch_size, context_len) -> k`` from a local copy of the table (microseconds,
  fail-static without a sidecar) and follows the table through Redis; ``build_engine_hooks`` wires it to the
  telemetry emitter. The reference engine uses it exactly as a third-party engine would.
- :mod:`controller.engines`: the same, inside another serving engine's process and imported by that engine only.
  ``vllm/`` is the ``--scheduler-cls`` subclass that sets vLLM's per-step k from the table and turns each step
  into round records, and ``spectune vllm serve``.
- :mod:`controller.service`: the sidecar (never imports torch). It consumes windows from Redis Streams, stores
  them, feeds the policy, publishes the table (one leader at a time among several sidecars), raises drift alerts
  (``alerts/``) and serves the operator HTTP endpoint and Prometheus metrics. ``build_sidecar`` in
  ``service/build.py`` is its one composition root.
- :mod:`controller.offline`: tools over recorded telemetry and other engines' configurations: ``spectune
  ingest`` (vLLM, SGLang and TensorRT-LLM telemetry into the store), the calibrated simulator and the replay of
  stored windows, ``spectune tune`` (optuna) and ``spectune export`` (the engines' start-up formats).
- :mod:`controller.reference`: drivers of spectune's own torch engine: ``spectune demo``, the phased workload and
  the ``spectune engine`` process.
- :mod:`controller.report`: ``spectune report``'s views of the stored windows.
- :mod:`controller.cli`: the ``spectune`` command, the one place that reads the environment; each subcommand
  imports only what it runs. :mod:`controller.signals` is the one place that turns SIGINT/SIGTERM into a stop.

Nothing else in the product imports this package (``bench`` and the tests do); it may import the rest:
``engine``, ``telemetry``, ``policies`` and ``migrations`` (``tests/test_imports.py`` checks the direction).
"""
