"""The sidecar service: consumes windows, runs the policy, publishes the table, serves operators.

Never imports torch (a test enforces it): it runs beside an engine it does not share a process with.
"""
