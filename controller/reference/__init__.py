"""Drivers of spectune's own reference engine: the demo, the workload generator and the engine process.

These import torch; nothing in `controller.service` imports them.
"""
