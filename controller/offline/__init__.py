"""Working with serving engines outside ours: ingest their telemetry, export their start-up configs.

- :mod:`controller.offline.sources`: one parser per external format (vLLM Prometheus text, vLLM log lines,
  vLLM per-request metrics, SGLang ``meta_info`` and gauges, TensorRT-LLM iteration stats). Pure: text in,
  windows out, no I/O.
- :mod:`controller.offline.ingest`: runs a parser over a file, stdin or a ``/metrics`` URL, stores the windows,
  and keeps every line it could not use (with its line number and reason) in a rejects file.
- :mod:`controller.offline.project` / :mod:`controller.offline.export`: project spectune's (request type,
  batch, context) table onto each engine's format, validate it against the engine's documented rules, and
  predict what the projection costs.
- :mod:`controller.offline.cli`: ``spectune ingest`` and ``spectune export``.
"""
