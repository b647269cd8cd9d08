"""A real ``vllm serve`` (vLLM's own environment, built by ``make vllm``) steered by spectune, once per session.

The server runs the ``small`` profile (target-v1 with draft-v1, exported as HuggingFace Llama directories) with
:class:`~controller.engines.vllm.scheduler.SpectuneScheduler`, following a Redis prefix of its own. vLLM is a
real component of this project: a missing vLLM environment fails these tests, it does not skip them.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from live_server import Server

from controller.engines.vllm.serve import DEFAULT_VLLM_VENV, VllmServeConfig, start, stop, wait_ready

VLLM_PYTHON = Path(os.environ.get("SPECTUNE_VLLM_PYTHON", str(DEFAULT_VLLM_VENV / "bin" / "python")))
STARTUP_S = 420.0  # vLLM imports and spawns three processes; on two busy cores this took up to 100 s


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick), for a server started right after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: run `make vllm` (vLLM is a real component, "
                    "its tests are not skipped)", pytrace=False)
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def vllm_server(vllm_python: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("vllm")
    port = free_port()
    prefix = f"spectune-vllm-test-{uuid.uuid4().hex[:10]}"
    cfg = VllmServeConfig(
        profile="small", models_dir=work / "models", redis_url=redis_url, prefix=prefix, engine_id="vllm-test",
        port=port, vllm_python=vllm_python, status_path=work / "status.jsonl", status_every_s=0.5,
        default_k=3, trace_path=work / "trace.jsonl",
        extra_args=("--enforce-eager", "--max-num-seqs", "16"))  # no torch.compile: a minute less to start
    log = work / "vllm.log"
    proc = start(cfg, log, env={"VLLM_LOG_STATS_INTERVAL": "1"})
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, STARTUP_S, log)
        yield Server(f"http://127.0.0.1:{port}", "target-v1", redis_url, prefix, log, work / "status.jsonl",
                     threading.Lock(), work / "trace.jsonl")
    finally:
        stop(proc)
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()
