"""Train the target, distil the draft from it, and fine-tune a second target version on a shifted mix.

``spectune train`` runs :func:`train_all`; each stage is resumable from its last state in ``work_dir`` (kill it,
run it again, it carries on). The shipped checkpoints in ``checkpoints/`` and their ``manifest.json`` are its
output; the manifest records the exact command, seconds, parameter counts, held-out bits per byte per request
type and the zlib compression ratio of sampled text against real held-out text.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.checkpoint import CHECKPOINT_DIR, MANIFEST, describe_profiles, load_checkpoint
from engine.corpus import REQUEST_TYPES, Corpus, compression_ratio, held_out_prompts, load_corpus
from engine.model import BOS_ID, EOS_ID, MODEL_PRESETS, Transformer

RESUME_FREE_FIELDS = ("long_seq_len", "long_frac", "save_every")  # affect only steps not yet taken
EVAL_WINDOWS = 48  # held-out windows per request type for bits per byte
SAMPLE_BYTES = 384  # bytes sampled per prompt for the compression-ratio check
SAMPLE_PROMPTS = 6


@dataclass(frozen=True)
class TrainConfig:
    """One training stage."""

    name: str  # checkpoint name, e.g. "target-v1"
    preset: str  # key of MODEL_PRESETS
    steps: int  # optimizer steps
    batch_size: int = 32  # sequences per step
    seq_len: int = 256  # bytes per sequence
    lr: float = 3e-3  # peak AdamW learning rate
    min_lr_frac: float = 0.1  # cosine floor as a fraction of lr
    warmup: int = 200  # linear warm-up steps
    weight_decay: float = 0.05
    mix: dict[str, float] = field(default_factory=lambda: {"code": 0.5, "prose": 0.3, "structured": 0.2})
    structured_schema: int = 1  # 2 = the shifted mix of the second target version
    distill_from: str | None = None  # teacher checkpoint name: train on its logits (KL) plus the data (CE)
    distill_weight: float = 0.8  # weight of the KL term when distilling
    init_from: str | None = None  # start from this checkpoint's weights (fine-tuning)
    seed: int = 0
    save_every: int = 200  # steps between resumable states
    long_seq_len: int = 1024  # the final steps train on long windows so the model serves long contexts
    long_frac: float = 0.25  # fraction of steps (at the end) on long windows, batch scaled to keep tokens/step

    def __post_init__(self) -> None:
        if self.preset not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {sorted(MODEL_PRESETS)}")
        if self.steps <= 0 or self.batch_size <= 0 or self.seq_len <= 1:
            raise ValueError("steps, batch_size must be positive and seq_len > 1")
        if not 0.0 <= self.long_frac <= 1.0 or self.long_seq_len < self.seq_len:
            raise ValueError("long_frac must be in [0, 1] and long_seq_len >= seq_len")
        if set(self.mix) - set(REQUEST_TYPES) or not math.isclose(sum(self.mix.values()), 1.0, abs_tol=1e-6):
            raise ValueError(f"mix must map request types {REQUEST_TYPES} to weights summing to 1, got {self.mix}")


def stages(scale: float = 1.0) -> list[TrainConfig]:
    """The three stages that produce the shipped checkpoints. ``scale`` shrinks steps for smoke runs."""

    def s(n: int) -> int:
        return max(2, int(n * scale))

    return [
        TrainConfig(name="target-v1", preset="target", steps=s(2400), warmup=100, long_frac=0.15),
        TrainConfig(
            name="draft-v1", preset="draft", steps=s(700), distill_from="target-v1", lr=4e-3, warmup=100, seed=1
        ),
        TrainConfig(
            name="target-v2",
            preset="target",
            steps=s(200),
            init_from="target-v1",
            lr=1e-3,
            warmup=20,
            # The "model update": more structured data in a new schema, less prose.
            mix={"code": 0.45, "prose": 0.15, "structured": 0.4},
            structured_schema=2,
            seed=2,
        ),
    ]


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def batch_shape(cfg: TrainConfig, step: int) -> tuple[int, int]:
    """(batch size, sequence length) at ``step``: short windows first, long windows for the last steps."""
    if step >= cfg.steps * (1.0 - cfg.long_frac):
        return max(1, cfg.batch_size * cfg.seq_len // cfg.long_seq_len), cfg.long_seq_len
    return cfg.batch_size, cfg.seq_len


def sample_batch(
    corpus: Corpus, cfg: TrainConfig, gen: torch.Generator, shape: tuple[int, int] | None = None
) -> torch.Tensor:
    """Random windows of ``seq_len + 1`` tokens, request types drawn by ``cfg.mix``.

    Returns:
        ``[batch_size, seq_len + 1]`` int64 (``shape`` overrides the config's batch size and length).
    """
    bsz, seq = shape or (cfg.batch_size, cfg.seq_len)
    kinds = list(cfg.mix)
    probs = torch.tensor([cfg.mix[k] for k in kinds])
    which = torch.multinomial(probs, bsz, replacement=True, generator=gen)
    out = torch.empty(bsz, seq + 1, dtype=torch.long)
    for i, w in enumerate(which.tolist()):
        stream = corpus.train[kinds[w]]
        start = int(torch.randint(0, len(stream) - seq - 1, (1,), generator=gen))
        out[i] = torch.from_numpy(stream[start : start + seq + 1].astype(np.int64))
    return out


def eval_windows(stream: np.ndarray, seq_len: int, n: int) -> torch.Tensor:
    """Evenly spaced held-out windows (deterministic). Returns ``[n, seq_len + 1]``."""
    n = max(1, min(n, (len(stream) - 1) // (seq_len + 1)))
    starts = np.linspace(0, len(stream) - seq_len - 2, n).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def bits_per_byte(model: Transformer, corpus: Corpus, seq_len: int = 256, n: int = EVAL_WINDOWS) -> dict[str, float]:
    """Held-out cross-entropy in bits per byte, per request type (BOS/EOS targets excluded)."""
    model.eval()
    out = {}
    for kind in REQUEST_TYPES:
        w = eval_windows(corpus.held_out[kind], seq_len, n)
        logits = model(w[:, :-1]).float()
        tgt = w[:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
        keep = (tgt.reshape(-1) < BOS_ID).float()
        out[kind] = float((nll * keep).sum() / keep.sum() / math.log(2))
    return out


@torch.no_grad()
def sample_text(model: Transformer, prompt: bytes, n_bytes: int, temperature: float, seed: int) -> bytes:
    """Plain autoregressive sampling with the KV cache (used for the honesty check)."""
    gen = torch.Generator().manual_seed(seed)
    toks = torch.tensor([[BOS_ID, *prompt]], dtype=torch.long)
    cache = model.new_cache(1, len(prompt) + n_bytes + 2)
    logits = model.forward_cached(toks, cache)[:, -1]
    out = bytearray()
    for _ in range(n_bytes):
        probs = torch.softmax(logits / temperature, dim=-1)
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        if nxt == EOS_ID:
            break
        if nxt < 256:
            out.append(nxt)
        logits = model.forward_cached(torch.tensor([[nxt]]), cache)[:, -1]
    return bytes(out)


def honesty_check(model: Transformer, schema: int) -> dict[str, dict[str, float]]:
    """zlib ratio of sampled text (temperature 1.0) next to real held-out text of the same kind and length."""
    model.eval()
    out = {}
    for kind in REQUEST_TYPES:
        prompts = held_out_prompts(kind, SAMPLE_PROMPTS, 128, seed=7, schema_version=schema)
        real = held_out_prompts(kind, SAMPLE_PROMPTS, SAMPLE_BYTES, seed=11, schema_version=schema)
        sampled = [sample_text(model, p, SAMPLE_BYTES, 1.0, seed=i) for i, p in enumerate(prompts)]
        out[kind] = {
            "sampled": float(np.median([compression_ratio(s) for s in sampled if s] or [0.0])),
            "held_out": float(np.median([compression_ratio(r) for r in real])),
        }
    return out


def _state_path(work_dir: Path, name: str) -> Path:
    return work_dir / f"{name}.state.pt"


def train_stage(
    cfg: TrainConfig,
    corpus: Corpus,
    work_dir: Path,
    out_dir: Path,
    log: Callable[[str], None] = print,
) -> dict[str, object]:
    """Train one stage, resuming from ``work_dir`` if a state exists. Returns its manifest entry."""
    torch.manual_seed(cfg.seed)
    model = Transformer(MODEL_PRESETS[cfg.preset])
    if cfg.init_from:
        model.load_state_dict(load_checkpoint(cfg.init_from, out_dir).state_dict())
    teacher = load_checkpoint(cfg.distill_from, out_dir) if cfg.distill_from else None
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    step, seconds = 0, 0.0
    sp = _state_path(work_dir, cfg.name)
    if sp.exists():
        st = torch.load(sp, weights_only=False)
        same = all(st["config"].get(f) == v for f, v in asdict(cfg).items() if f not in RESUME_FREE_FIELDS)
        if same and st["step"] <= cfg.steps:
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["opt"])
            gen.set_state(st["gen"])
            step, seconds = st["step"], st["seconds"]
            log(f"[{cfg.name}] resumed at step {step}")
    model.train()
    t_last = time.perf_counter()
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        batch = sample_batch(corpus, cfg, gen, batch_shape(cfg, step))
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(x).float(), dim=-1)
            kl = F.kl_div(F.log_softmax(logits, dim=-1), t_logp, log_target=True, reduction="batchmean") / x.shape[1]
            loss = cfg.distill_weight * kl + (1 - cfg.distill_weight) * loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.perf_counter()
        seconds += now - t_last
        t_last = now
        if step % 50 == 0:
            log(f"[{cfg.name}] step {step}/{cfg.steps} loss {loss.item():.3f} {seconds:.0f}s")
        if step % cfg.save_every == 0 or step == cfg.steps:
            work_dir.mkdir(parents=True, exist_ok=True)
            tmp = sp.with_suffix(".tmp")
            torch.save(
                {"config": asdict(cfg), "model": model.state_dict(), "opt": opt.state_dict(),
                 "gen": gen.get_state(), "step": step, "seconds": seconds},
                tmp,
            )
            tmp.replace(sp)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{cfg.name}.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}, str(path))
    # Evaluate the weights as shipped (bf16 rounding included).
    shipped = Transformer(MODEL_PRESETS[cfg.preset])
    shipped.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()})
    eval_corpus = corpus if cfg.structured_schema == 1 else load_corpus(structured_schema=1)
    entry: dict[str, object] = {
        "version_id": cfg.name,
        "preset": cfg.preset,
        "config": MODEL_PRESETS[cfg.preset].to_dict(),
        "params": shipped.num_params(),
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "dtype": "bfloat16",
        "train": asdict(cfg),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_seconds": round(seconds, 1),
        "held_out_bits_per_byte": bits_per_byte(shipped, eval_corpus),
        "held_out_bits_per_byte_long": bits_per_byte(shipped, eval_corpus, seq_len=cfg.long_seq_len, n=12),
        "compression_ratio": honesty_check(shipped, 1),
    }
    if cfg.structured_schema != 1:
        entry["held_out_bits_per_byte_shifted"] = bits_per_byte(shipped, corpus)
    log(f"[{cfg.name}] done: {json.dumps(entry['held_out_bits_per_byte'])}")
    return entry


def train_all(
    work_dir: Path, out_dir: Path = CHECKPOINT_DIR, scale: float = 1.0, threads: int | None = None,
    only: list[str] | None = None, log: Callable[[str], None] = print,
) -> dict[str, object]:
    """Run every stage in order and write the manifest. Stages whose checkpoint exists are re-used."""
    if threads:
        torch.set_num_threads(threads)
    manifest_path = out_dir / MANIFEST
    manifest: dict = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.setdefault("checkpoints", {})
    manifest["command"] = "spectune train" + (f" --scale {scale}" if scale != 1.0 else "")
    manifest["python"] = sys.version.split()[0]
    manifest["torch"] = torch.__version__
    manifest["machine"] = platform.machine()
    corpora: dict[int, Corpus] = {}
    for cfg in stages(scale):
        if only and cfg.name not in only:
            continue
        if cfg.name in manifest["checkpoints"] and (out_dir / f"{cfg.name}.safetensors").exists() and not only:
            log(f"[{cfg.name}] checkpoint exists, skipping")
            continue
        if cfg.structured_schema not in corpora:
            corpora[cfg.structured_schema] = load_corpus(structured_schema=cfg.structured_schema)
        entry = train_stage(cfg, corpora[cfg.structured_schema], work_dir, out_dir, log)
        manifest = _merge_manifest(manifest_path, manifest, cfg.name, entry)
    if "target-v1" in manifest["checkpoints"] and "derived" not in manifest:  # every stage was re-used
        manifest = _merge_manifest(manifest_path, manifest, "target-v1", manifest["checkpoints"]["target-v1"])
    return manifest


def _merge_manifest(path: Path, base: dict, name: str, entry: dict[str, object]) -> dict:
    """Write one stage's entry into the manifest on disk, keeping entries other processes wrote meanwhile.

    Stages that do not depend on each other (the draft and the second target both need only target-v1) may run
    as separate processes; the lock makes their read-modify-write of the manifest safe.
    """
    import fcntl

    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = json.loads(path.read_text()) if path.exists() else {}
        merged = {**base, **{k: v for k, v in current.items() if k != "checkpoints"}}
        merged["checkpoints"] = {**base.get("checkpoints", {}), **current.get("checkpoints", {}), name: entry}
        if "target-v1" in merged["checkpoints"]:
            # The derived stand-ins (the xl profile's widened target) are built at load time, not shipped: the
            # manifest says what they are, so nobody takes them for separately trained models.
            merged["derived"] = describe_profiles(merged["checkpoints"]["target-v1"]["config"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(merged, indent=2) + "\n")
        tmp.replace(path)
    return merged
