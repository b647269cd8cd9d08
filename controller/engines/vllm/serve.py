"""``spectune vllm serve``: vLLM serving spectune's exported models, speculating with its draft, steered by spectune.

It is the one command an operator runs in place of ``vllm serve``:

1. exports the profile's target and draft as HuggingFace Llama directories when they are missing or were made
   from other checkpoints (:mod:`engine.hf_export`);
2. runs ``vllm serve TARGET`` in vLLM's own virtual environment (``make vllm``) with the draft
   (``--speculative-config {"method": "draft_model", ...}``), :class:`SpectuneScheduler` (``--scheduler-cls``)
   and its settings (``--additional-config {"spectune": ...}``), so that each step's k comes from the policy
   table in Redis and each step's outcome goes back as round records;
3. passes every other flag through to vLLM (later flags win, so an operator may override any default here).

The process becomes vLLM's (``exec``): signals, logs and the exit status are vLLM's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.engines.vllm.draft_sync import MODE_ENV as DRAFT_SYNC_ENV
from controller.engines.vllm.draft_sync import MODES as DRAFT_SYNC_MODES
from controller.engines.vllm.steps import ADDITIONAL_CONFIG_KEY, VllmSpectuneConfig
from engine.profiles import DEFAULT_PROFILE, get_profile
from telemetry.errors import SpectuneError
from telemetry.transport import DEFAULT_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_VLLM_VENV = REPO_ROOT / ".venv-vllm"  # what `make vllm` builds
DEFAULT_MODELS_DIR = REPO_ROOT / ".spectune_cache" / "models"  # exports, per profile
SCHEDULER_CLS = "controller.engines.vllm.scheduler.SpectuneScheduler"
LAUNCH_MODULE = "controller.engines.vllm.launch"
DEFAULT_K_MAX = 8  # the sidecar's default --k-max: a table asking more than vLLM's k_max is refused whole
DEFAULT_KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: the byte-level models need little; vLLM's default is 4 GiB
DEFAULT_PORT = 8000


class VllmError(SpectuneError):
    """vLLM cannot be started as asked (no vLLM environment, a model that will not export, a server that
    never answered)."""


@dataclass(frozen=True)
class VllmServeConfig:
    """One ``vllm serve`` steered by spectune."""

    profile: str = DEFAULT_PROFILE  # target/draft pair (engine/profiles.py)
    models_dir: Path = DEFAULT_MODELS_DIR  # exported directories live under models_dir/profile
    k_max: int = DEFAULT_K_MAX  # vLLM's num_speculative_tokens: the largest k the table may ask for
    redis_url: str | None = None  # None: no telemetry, no table (fail-static, or fixed_k)
    prefix: str = DEFAULT_PREFIX
    engine_id: str = "vllm-0"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    default_k: int | None = None  # fail-static k (None: k_max)
    fixed_k: int | None = None  # follow no table: every step drafts this k
    speculate: bool = True  # False: plain vLLM, no draft, no spectune scheduler (the k = 0 baseline)
    steer: bool = True  # False: vLLM's own scheduler with a static k_max or native_schedule (baselines)
    native_schedule: tuple[tuple[int, int, int], ...] | None = None  # num_speculative_tokens_per_batch_size
    # an exported start-up config (``spectune export vllm``), passed to vLLM as it is; vLLM's own scheduler
    # follows its table (no steering); a draft_model config without a model gets the profile's draft
    speculative_config: Mapping[str, Any] | None = None
    kv_cache_gib: int = DEFAULT_KV_CACHE_GIB
    # the draft's KV sync at k = 0 (controller/engines/vllm/draft_sync.py): "lazy" runs no draft while k = 0 and
    # catches the draft's cache up when drafting resumes; "eager" is vLLM's own (the draft runs every step)
    draft_sync: str = "lazy"
    vllm_python: Path = DEFAULT_VLLM_VENV / "bin" / "python"
    status_path: Path | None = None  # the scheduler appends JSON status lines here
    status_every_s: float = 5.0
    trace_path: Path | None = None  # the scheduler appends one JSON line per step here (diagnosis)
    cost_mixed_steps: bool = False  # steps with prompt tokens teach cost too (VllmSpectuneConfig.cost_mixed_steps)
    window_s: float = 0.25
    extra_args: tuple[str, ...] = field(default=())  # passed to vllm serve as they are, after ours

    def __post_init__(self) -> None:
        get_profile(self.profile)
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")
        if self.kv_cache_gib < 1:
            raise ValueError("--kv-cache-gib must be >= 1")
        if self.draft_sync not in DRAFT_SYNC_MODES:
            raise ValueError(f"--draft-sync must be one of {', '.join(DRAFT_SYNC_MODES)}, got {self.draft_sync!r}")
        self.spectune_config()  # validates k_max, default_k, fixed_k, engine_id, prefix
        if self.speculative_config is not None and (self.steer or not self.speculate):
            raise ValueError("an exported --speculative-config is vLLM's own schedule: it takes steer=False and "
                             "speculation on")

    def spectune_config(self, versions: tuple[str, str] = ("target", "draft")) -> VllmSpectuneConfig:
        return VllmSpectuneConfig(
            target_version=versions[0], draft_version=versions[1], k_max=self.k_max, engine_id=self.engine_id,
            redis_url=self.redis_url, prefix=self.prefix, default_k=self.default_k, fixed_k=self.fixed_k,
            window_s=self.window_s, status_path=str(self.status_path) if self.status_path else None,
            status_every_s=self.status_every_s, trace_path=str(self.trace_path) if self.trace_path else None,
            cost_mixed_steps=self.cost_mixed_steps)


@dataclass(frozen=True)
class ServedModels:
    """The exported directories one server uses."""

    target: Path
    draft: Path
    target_version: str
    draft_version: str


def ensure_models(profile: str, models_dir: Path, say: Any = print) -> ServedModels:
    """The profile's exported target-v1 and draft-v1, exported now when missing or made from other checkpoints."""
    from engine.checkpoint import CHECKPOINT_DIR, DRAFT_V1, MANIFEST, TARGET_V1

    prof = get_profile(profile)
    out = models_dir / prof.name
    manifest = json.loads((CHECKPOINT_DIR / MANIFEST).read_text())["checkpoints"]
    target_v, draft_v = prof.target_version(TARGET_V1), DRAFT_V1

    def current(version: str, checkpoint: str) -> bool:
        info = out / version / "spectune.json"
        if not (info.exists() and (out / version / "model.safetensors").exists()):
            return False
        return bool(json.loads(info.read_text()).get("checkpoint_sha256") == manifest[checkpoint]["sha256"])

    if not (current(target_v, TARGET_V1) and current(draft_v, DRAFT_V1)):
        from engine.hf_export import export_profile

        say(f"exporting the {prof.name} models as HuggingFace Llama directories under {out}")
        export_profile(prof, out)
    return ServedModels(out / target_v, out / draft_v, target_v, draft_v)


def vllm_environment(cfg: VllmServeConfig, base: Mapping[str, str]) -> dict[str, str]:
    """The environment vLLM runs in: a small CPU KV cache, Intel OpenMP preloaded when the venv has it, the draft's
    KV sync mode when it speculates."""
    env = dict(base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    if cfg.speculate:
        env[DRAFT_SYNC_ENV] = cfg.draft_sync
    else:  # a server without a draft has no draft to sync: nothing is installed in it
        env.pop(DRAFT_SYNC_ENV, None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    iomp = cfg.vllm_python.parent.parent / "lib" / "libiomp5.so"  # the intel-openmp wheel puts it in venv/lib
    if iomp.exists() and str(iomp) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env


def vllm_command(cfg: VllmServeConfig, models: ServedModels, cuda: bool = False) -> list[str]:
    """``vllm serve`` for ``models`` with spectune's scheduler (or plain, without ``speculate``)."""
    cmd = [str(cfg.vllm_python), "-m", LAUNCH_MODULE, "serve", str(models.target),
           "--served-model-name", models.target_version,
           "--host", cfg.host, "--port", str(cfg.port),
           "--dtype", "bfloat16" if cuda else "float32",  # CPU: fp32, as spectune's engine; CUDA: bf16
           "--seed", "0"]
    if cfg.speculative_config is not None:
        spec = dict(cfg.speculative_config)
        if spec.get("method", "draft_model") == "draft_model":
            spec.setdefault("method", "draft_model")
            spec.setdefault("model", str(models.draft))
        return [*cmd, "--speculative-config", json.dumps(spec), *cfg.extra_args]
    if cfg.speculate:
        spec = {"method": "draft_model", "model": str(models.draft), "num_speculative_tokens": cfg.k_max}
        if cfg.native_schedule is not None:
            spec["num_speculative_tokens_per_batch_size"] = [list(e) for e in cfg.native_schedule]
        cmd += ["--speculative-config", json.dumps(spec)]
        if cfg.steer:
            sc = cfg.spectune_config((models.target_version, models.draft_version))
            cmd += ["--scheduler-cls", SCHEDULER_CLS,
                    "--additional-config", json.dumps({ADDITIONAL_CONFIG_KEY: json.loads(sc.to_json())})]
            if cuda:
                cmd.append("--no-async-scheduling")  # SpectuneScheduler pairs each schedule() with its output
    return cmd + list(cfg.extra_args)


def check_vllm_python(path: Path) -> None:
    if not path.exists():
        raise VllmError(f"no vLLM environment at {path}: run `make vllm` (or pass --vllm-python)")


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def serve(cfg: VllmServeConfig, say: Any = print) -> int:
    """Export when needed, then become ``vllm serve`` (never returns on success)."""
    check_vllm_python(cfg.vllm_python)
    models = ensure_models(cfg.profile, cfg.models_dir, say)
    cmd = vllm_command(cfg, models, cuda=_cuda())
    how = (", k from the exported table" if cfg.speculative_config is not None else
           f", k from spectune (k <= {cfg.k_max})" if cfg.speculate else ", no speculation")
    say(f"vllm serve {models.target_version} with draft {models.draft_version} on http://{cfg.host}:{cfg.port}"
        + how)
    sys.stdout.flush()
    os.execve(cmd[0], cmd, vllm_environment(cfg, os.environ))
    return 0  # not reached


def start(cfg: VllmServeConfig, log_path: Path, say: Any = print, env: Mapping[str, str] | None = None
          ) -> subprocess.Popen[bytes]:
    """Start ``vllm serve`` as a child process writing to ``log_path`` (tests and benchmarks).

    Args:
        env: variables set for vLLM on top of this process's environment (``VLLM_LOG_STATS_INTERVAL``, ...).
    """
    check_vllm_python(cfg.vllm_python)
    models = ensure_models(cfg.profile, cfg.models_dir, say)
    cmd = vllm_command(cfg, models, cuda=_cuda())
    log = log_path.open("ab")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=vllm_environment(cfg, {**os.environ, **(env or {})}), start_new_session=True)
    finally:
        log.close()


def wait_ready(base_url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float, log_path: Path | None = None
               ) -> None:
    """Poll ``/health`` until vLLM answers; raise :class:`VllmError` with the log's tail when it never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    tail = ""
    if log_path is not None and log_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
    state = "exited" if proc is not None and proc.poll() is not None else f"not ready after {timeout_s:.0f} s"
    raise VllmError(f"vllm serve {state}; last lines of its log:\n{tail}")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> int:
    """SIGTERM the API server (it shuts its engine down, which flushes spectune's telemetry) and wait; SIGKILL the
    whole process group when it has not exited after ``timeout_s``."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # workers left behind by a server that died
    if proc.poll() is None:
        proc.wait(10)
    return int(proc.returncode)


def parse_extra(argv: Sequence[str]) -> tuple[str, ...]:
    """Everything after ``--`` (or unknown flags) goes to vLLM as given."""
    return tuple(a for a in argv if a != "--")
