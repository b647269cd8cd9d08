"""``spectune tune``: optuna studies that replay stored telemetry, on the telemetry's own database.

Two targets (``--target``):

- ``table``: a static table, one k per (request type, batch bucket, context bucket) the stored traffic used, for
  engines that take a table at start-up. Each trial is scored by the analytic replay of
  :mod:`controller.offline.replay` (deterministic). Buckets with less than ``min_share`` of the replayed windows
  keep the seed table's k (a bucket the objective barely sees would get whatever k the sampler drew).
- ``goodput``: the hyper-parameters of :class:`policies.goodput.GoodputPolicy`, each trial a round-level replay
  in which the policy learns from scratch.

The objective is tokens/s; ``--latency-objective`` adds p99 per-token latency as a second objective (a Pareto
front), ``--p99-slo S`` makes ``p99 <= S`` a constraint of the sampler (``constraints_func``). The study lives in
``optuna.storages.RDBStorage`` on the same database as the telemetry by default, so several processes can share
one ``--study`` and a killed run resumes: ``--trials`` is the study's total of finished trials, not this run's.
The first trial is the seed (the latest published table, ``--seed-table``, or the policy's defaults).

The stored windows are split by time: the first ``1 - holdout`` tune, the last ``holdout`` check the result by a
round-level replay (acceptance and, without ``--calibration``, cost learnt from the held-out windows alone). The
check gives a verdict only on at least :data:`MIN_HELDOUT_WINDOWS` engine windows and :data:`MIN_HELDOUT_ROWS`
rows of acceptance; on less it says so and gives none.

Honesty rules:

- **Missing telemetry is named.** Before anything runs, the stored windows are checked per (target, draft)
  versions: acceptance windows for the ks engines drafted, cost windows (batch sizes and round seconds). What is
  missing is said with the ingest source or the ``--calibration`` file that supplies it. Without cost windows a
  recorded sweep (``--calibration``) supplies both the cost and the batch sizes replayed.
- **No k past the measurements.** A table k is searched only up to the largest k drafted in the acceptance
  windows of its (request type, context bucket), over every version (its request type's, then every window's,
  where it has none): past that the acceptance curve would be extrapolated. ``--allow-extrapolation`` searches up
  to ``--k-max``. The tuned table's other entries and default are capped at the largest k drafted anywhere.
- **An interrupted study leaves no trial RUNNING.** SIGINT or SIGTERM during the study stop it after the trial in
  flight (a second one fails that trial at once); optuna's bookkeeping is never interrupted. The run prints what
  the study holds and exits with 128 + the signal's number (130 for Ctrl-C), without storing a table.
- **The tuned table is stored** as the store's next policy version (``spectune export --db-url`` then finds it;
  ``--no-store`` keeps it out; a sidecar on the same store would follow it as a peer's table).
- **One prediction.** The figures over every stored window come from :func:`controller.offline.replay.store_replay`,
  the one ``spectune export`` predicts with, so both give the same tokens/s for the same table and cost source.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal

from controller.offline.replay import (
    Pair,
    Replay,
    ReplayError,
    Score,
    Slice,
    SweepCost,
    TablePolicy,
    build_replay,
    split_by_time,
    store_replay,
)
from engine.profiles import PROFILE_NAMES
from telemetry.errors import SpectuneError, StoreRejectedError
from telemetry.policy_table import check_table_size, lookup, policy_table_from_json, table_to_json
from telemetry.records import MAX_DRAFT_LEN, WILDCARD, AcceptanceWindow, Bucket, CostWindow, PolicyTable, RecordError
from telemetry.store import DEFAULT_DB_URL, StoredWindow
from telemetry.urls import redact_url

TARGETS = ("table", "goodput")
DEFAULT_PROFILE = "xl"  # the large model's cost: where the choice of k matters most
DEFAULT_SEED_K = 3  # seed table when none is published nor given (StaticPolicy's default k)
DEFAULT_HOLDOUT = 0.3
MIN_SHARE = 0.005  # buckets with less of the replayed windows keep the seed's k (see the module docstring)
HEARTBEAT_S = 10  # a trial whose process died is failed after GRACE_S without a heartbeat
GRACE_S = 30
ROLE = "spectune_role"  # user attribute marking the enqueued trials: "seed", "model" (Space.model_params)
META = "spectune"  # study user attribute: what the study tunes (checked when a run joins it)
METRIC_NAMES = ("goodput_tok_s", "tpot_p99_s")  # the objectives as optuna-dashboard shows them
# The held-out verdict needs this much held-out telemetry: fewer engine windows say little about traffic that
# moves from window to window, and fewer rows of acceptance leave the acceptance length uncertain by more than the
# few percent a table wins (one row's accepted tokens spread by about one token around a mean of 1-4).
MIN_HELDOUT_WINDOWS = 10
MIN_HELDOUT_ROWS = 1000
STORE_ATTEMPTS = 3  # a sidecar on the same store may take the next version number meanwhile
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_SIGNAL_BASE = 128  # a run stopped by signal N exits 128 + N, as a shell reports it (130 for Ctrl-C)
ACCEPTANCE_SOURCES = (
    "`spectune ingest vllm-prom` (the spec_decode per-position counters of /metrics), `vllm-log` (SpecDecoding "
    "metrics lines), `vllm-request` (per-request metrics) or `sglang` (meta_info with spec_correct_drafts_histogram), "
    "with --version V naming the same target version; TensorRT-LLM iteration stats give acceptance windows only at "
    "k = 1 or where nothing or everything was accepted (their totals fix no histogram past k = 1)")
COST_SOURCES = (
    "`spectune ingest vllm-prom` (inter-token latency histogram and running requests of /metrics) or `trtllm` "
    "(iteration stats: iterLatencyMS and the drafting rows), with --version V naming the same target version; or "
    "pass --calibration FILE, a recorded engine sweep in the format of `spectune bench engine`'s engine.json (cells "
    "of batch_size, context, context_len, request_type, round_s {k: {draft, verify, other} seconds} for every k up "
    "to --k-max, and accept_hist; e.g. tests/policies/fixture_engine.json), whose batch sizes are then replayed")
# GoodputPolicy hyper-parameters tuned, with their ranges: (low, high, kind).
GOODPUT_SPACE: dict[str, tuple[float, float, str]] = {
    "switch_margin": (0.0, 0.2, "float"),
    "off_margin": (0.0, 0.3, "float"),
    "hold_decisions": (0, 10, "int"),
    "explore_radius": (1, 4, "int"),
    "explore_margin": (0.0, 0.2, "float"),
    "prior_mean": (0.2, 0.9, "float"),
    "probe_every": (10, 200, "int"),
}


class TuneError(SpectuneError):
    """A bad argument or a study that cannot go on; the message says what to do."""


class TuneInterrupted(TuneError):
    """A signal stopped the run before any trial finished."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


@dataclass(frozen=True)
class TuneConfig:
    """One ``spectune tune`` run (validated here: the CLI and tests build it)."""

    db_url: str = DEFAULT_DB_URL  # the telemetry (and by default the study)
    storage: str | None = None  # the optuna study's database; None: db_url
    study: str = "spectune-tune"  # several processes with one name share the study
    target: str = "table"  # "table" or "goodput"
    trials: int = 50  # the study's total of finished trials (a resumed run only adds what is missing)
    seed: int = 0  # the sampler's and the simulator's; give each process sharing a study its own
    calibration: Path | None = None  # a recorded sweep for the cost; None fits the cost model on stored windows
    profile: str = DEFAULT_PROFILE  # the sweep's profile
    k_max: int = 8  # the largest k a table may hold
    holdout: float = DEFAULT_HOLDOUT  # share of stored windows (the last by time) kept for the check
    latency_objective: bool = False  # a second objective: p99 per-token latency (Pareto front)
    p99_slo: float | None = None  # seconds; p99 <= slo as a sampler constraint
    seed_table: Path | None = None  # the table to beat; None: the latest published one in db_url
    out: Path | None = None  # plots and the tuned table
    summary_json: Path | None = None
    window_s: float = 0.5  # wall seconds of one replayed window
    noise: float = 0.03  # per-round noise of the round-level replay
    min_share: float = MIN_SHARE
    timeout_s: float | None = None  # stop this run after this many seconds (the study keeps what finished)
    progress: bool = True
    allow_extrapolation: bool = False  # search k past the largest k measured (acceptance extrapolated)
    store: bool = True  # store the tuned table as the next policy version of db_url (export finds it there)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise TuneError(f"--target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.trials < 1:
            raise TuneError(f"--trials must be >= 1 (the study's total of finished trials), got {self.trials}")
        if not 1 <= self.k_max <= MAX_DRAFT_LEN:
            raise TuneError(f"--k-max must be in [1, {MAX_DRAFT_LEN}], got {self.k_max}")
        if not 0.0 <= self.holdout < 1.0:
            raise TuneError(f"--holdout must be in [0, 1): the share of windows held out, got {self.holdout}")
        if self.p99_slo is not None and not self.p99_slo > 0:
            raise TuneError(f"--p99-slo must be > 0 seconds, got {self.p99_slo}")
        if self.profile not in PROFILE_NAMES:
            raise TuneError(f"--profile must be one of {', '.join(PROFILE_NAMES)}, got {self.profile!r}")
        if not self.study or len(self.study) > 512:
            raise TuneError("--study must be a non-empty name of at most 512 characters")
        if not self.window_s > 0 or self.noise < 0 or not 0 <= self.min_share < 1:
            raise TuneError("window_s must be > 0, noise >= 0 and min_share in [0, 1)")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise TuneError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        for what, p in (("--calibration", self.calibration), ("--seed-table", self.seed_table)):
            if p is not None and not p.is_file():
                raise TuneError(f"{what} {p} is not a file")

    @property
    def storage_url(self) -> str:
        return self.storage or self.db_url

    @property
    def directions(self) -> list[Literal["maximize", "minimize"]]:
        return ["maximize", "minimize"] if self.latency_objective else ["maximize"]


# ------------------------------------------------------------------------------------------------ search
@dataclass(frozen=True)
class Candidate:
    """What one trial proposes: a table (target ``table``) or GoodputPolicy kwargs (target ``goodput``)."""

    table: PolicyTable | None = None
    params: dict[str, Any] = field(default_factory=dict)


class Space:
    """The search space of a target and how a trial's parameters become a candidate.

    A table's k per bucket is searched in ``[0, cap]``: ``cap`` is ``k_max`` capped at the largest k drafted in
    the acceptance windows of the bucket's (request type, context bucket) over every version, else its request
    type's, else every window's (:func:`controller.offline.replay.measured_k`), and at the deepest k whose cost was
    measured at the bucket's batch or a larger one (:meth:`controller.offline.replay.Replay.cost_cap`), unless
    ``allow_extrapolation``.
    """

    def __init__(self, cfg: TuneConfig, replay: Replay, seed_table: PolicyTable) -> None:
        self.cfg, self.replay, self.seed_table = cfg, replay, seed_table
        self.cells: list[tuple[str, int, str]] = []  # (request type, batch bucket, context bucket)
        self.caps: dict[tuple[str, int, str], int] = {}  # the largest k searched per cell
        self.share: dict[tuple[str, int, str], float] = {}
        self.cost_capped: set[tuple[str, int, str]] = set()  # cells whose cap is the deepest k cost was measured at
        measured = replay.measured_k
        # the largest k any entry of the tuned table may hold (its default and the seed's untuned entries too)
        self.k_limit = cfg.k_max if cfg.allow_extrapolation else min(cfg.k_max, measured.get(("all",), cfg.k_max))
        if cfg.target == "table":
            share: dict[tuple[str, int, str], float] = {}
            n = replay.windows
            for spec, bb in zip(replay.load.specs, replay.load.buckets, strict=True):
                for rt, w in zip(replay.load.types, spec.mix, strict=True):
                    share[(rt, bb, spec.context)] = share.get((rt, bb, spec.context), 0.0) + w / n
            self.share = share
            self.cells = sorted(c for c, s in share.items() if s >= cfg.min_share)
            for rt, bb, ctx in self.cells:
                deepest = measured.get(("cell", rt, ctx), measured.get(("type", rt), self.k_limit))
                cap = cfg.k_max if cfg.allow_extrapolation else min(cfg.k_max, deepest)
                by_cost = None if cfg.allow_extrapolation else replay.cost_cap(bb, ctx)
                if by_cost is not None and by_cost < cap:
                    self.cost_capped.add((rt, bb, ctx))
                    cap = by_cost
                self.caps[(rt, bb, ctx)] = cap
            self.pairs = sorted(set(replay.load.pair_of.values()))
            self.main_pair = max(self.pairs, key=lambda p: sum(
                1 for s in replay.load.specs if replay.load.pair_of[s.version] == p))

    @staticmethod
    def param(cell: tuple[str, int, str]) -> str:
        return f"k:{cell[0]}|{cell[1]}|{cell[2]}"

    @property
    def names(self) -> list[str]:
        return [self.param(c) for c in self.cells] if self.cfg.target == "table" else list(GOODPUT_SPACE)

    @property
    def capped(self) -> bool:
        """Whether the measurements capped the search below ``--k-max`` anywhere."""
        return self.k_limit < self.cfg.k_max or any(c < self.cfg.k_max for c in self.caps.values())

    def suggest(self, trial: Any) -> dict[str, Any]:
        if self.cfg.target == "table":
            return {self.param(c): trial.suggest_int(self.param(c), 0, self.caps[c]) for c in self.cells}
        out: dict[str, Any] = {}
        for name, (lo, hi, kind) in GOODPUT_SPACE.items():
            out[name] = trial.suggest_int(name, int(lo), int(hi)) if kind == "int" else trial.suggest_float(
                name, lo, hi)
        return out

    def seed_params(self) -> dict[str, Any]:
        """The seed as trial parameters: the seed table's k per tuned bucket (within the searched space), or
        GoodputPolicy's defaults."""
        if self.cfg.target == "table":
            t, d = self.main_pair
            return {self.param(c): min(lookup(self.seed_table, Bucket(t, d, c[0], c[1], c[2])), self.caps[c])
                    for c in self.cells}
        return dict(goodput_defaults())

    def model_params(self) -> dict[str, Any] | None:
        """The replay model's own best table as trial parameters (:meth:`Replay.best_per_cell`, from the seed's ks
        elsewhere); None for the goodput target. Enqueued after the seed: the sampler then refines the model's
        answer instead of drawing 20-odd ks at once, where a bucket with a small share of the tokens (batch 1) moves
        the objective less than the draws' noise and once came out at k = 0 against a measured 2.2x at k = 5."""
        if self.cfg.target != "table":
            return None
        best = self.replay.best_per_cell(self.caps, self.replay.table_ks(self.seed_table))
        return {self.param(c): best[c] for c in self.cells}

    def candidate(self, params: dict[str, Any], note: str = "") -> Candidate:
        if self.cfg.target == "goodput":
            return Candidate(params=dict(params))
        base = self.seed_table
        entries = {key: min(k, self.k_limit) for key, k in base.entries.items()}
        for c in self.cells:
            k = min(int(params[self.param(c)]), self.caps[c])
            # Exact keys for every version pair seen (they outrank the seed's broader keys), and version
            # wildcards for versions the tuning data did not see (a model update).
            for t, d in self.pairs:
                entries[Bucket(t, d, c[0], c[1], c[2]).key()] = k
            entries["|".join((WILDCARD, WILDCARD, c[0], str(c[1]), c[2]))] = k
        table = PolicyTable(version=base.version + 1, default_k=min(base.default_k, self.k_limit),
                            k_max=max(base.k_max, self.cfg.k_max), entries=entries, created_at=0.0, reason=note[:500])
        try:
            return Candidate(table=policy_table_from_json(table_to_json(table)))
        except RecordError as e:
            raise TuneError(f"the tuned table is not valid: {e}") from e


def goodput_defaults() -> dict[str, Any]:
    import inspect

    from policies.goodput import GoodputPolicy

    sig = inspect.signature(GoodputPolicy.__init__)
    return {name: sig.parameters[name].default for name in GOODPUT_SPACE}


def score(cfg: TuneConfig, replay: Replay, cand: Candidate, round_level: bool, k_limit: int | None = None) -> Score:
    """Analytic (tables) or round-level (``round_level``, and always for the goodput policy) replay.

    ``k_limit``: the goodput policy's largest k (default ``cfg.k_max``; :attr:`Space.k_limit` keeps it within the
    measured ks)."""
    if cand.table is not None:
        if not round_level:
            return replay.score_table(cand.table)
        return replay.simulate(TablePolicy(cand.table, replay.load.pair_of, cfg.k_max), seed=cfg.seed, noise=cfg.noise)
    from policies.goodput import GoodputPolicy

    return replay.simulate(GoodputPolicy(k_max=k_limit if k_limit is not None else cfg.k_max, seed=cfg.seed,
                                         **cand.params), seed=cfg.seed, noise=cfg.noise)


# ------------------------------------------------------------------------------------------------ coverage
@dataclass
class Coverage:
    """What the stored windows measure, per (target, draft) versions."""

    acceptance_k: dict[Pair, set[int]] = field(default_factory=dict)  # ks drafted with acceptance windows
    acceptance_rows: dict[Pair, int] = field(default_factory=dict)
    cost_k: dict[Pair, set[int]] = field(default_factory=dict)  # ks engines ran (largest k of a round)
    cost_buckets: dict[Pair, set[int]] = field(default_factory=dict)  # batch buckets with cost windows

    @classmethod
    def of(cls, acc: Sequence[StoredWindow[AcceptanceWindow]], cost: Sequence[StoredWindow[CostWindow]]) -> Coverage:
        cov = cls()
        for sa in acc:
            a = sa.window
            p = (a.target_version, a.draft_version)
            cov.acceptance_k.setdefault(p, set()).add(a.k)
            cov.acceptance_rows[p] = cov.acceptance_rows.get(p, 0) + a.rows
        for sc in cost:
            c = sc.window
            p = (c.target_version, c.draft_version)
            cov.cost_k.setdefault(p, set()).add(c.max_k)
            cov.cost_buckets.setdefault(p, set()).add(c.batch_bucket)
        return cov

    def check(self, calibration: Path | None) -> list[str]:
        """Notes on what is missing but can be done without; raises :class:`TuneError` naming what is missing
        (for which versions, ks or batch buckets) and how to supply it when nothing can be tuned."""
        problems: list[str] = []
        if not self.acceptance_k:
            what = "; ".join(f"{_pair(p)}: k {_ks(self.cost_k[p] - {0})} at batch buckets {_ks(self.cost_buckets[p])}"
                             for p in sorted(self.cost_k)) or "no version"
            problems.append(f"no acceptance windows stored: nothing says how often drafts are accepted. Missing: "
                            f"acceptance windows for the ks engines drafted ({what}). Supply them with "
                            f"{ACCEPTANCE_SOURCES}")
        if not self.cost_k and calibration is None:
            what = "; ".join(f"{_pair(p)} (acceptance measured at k {_ks(ks)})"
                             for p, ks in sorted(self.acceptance_k.items())) or "no version"
            problems.append(f"no cost windows stored: nothing says at which batch sizes engines ran nor what a round "
                            f"costs. Missing: cost windows for the batch buckets engines serve ({what}; no batch "
                            f"size is stored). Supply them with {COST_SOURCES}")
        if problems:
            raise TuneError("cannot tune: " + "\n".join(problems))
        notes = []
        for p in sorted(set(self.cost_k) - set(self.acceptance_k)):
            drafted = self.cost_k[p] - {0}
            notes.append(f"versions {_pair(p)} have cost windows (k {_ks(self.cost_k[p])}, batch buckets "
                         f"{_ks(self.cost_buckets[p])}) but no acceptance windows of their own: their acceptance is "
                         f"borrowed from other versions' windows. Missing: acceptance windows of {_pair(p)} for k "
                         f"{_ks(drafted)}; supply them with {ACCEPTANCE_SOURCES}")
        for p in sorted(self.acceptance_k):
            unseen = self.cost_k.get(p, set()) - {0} - self.acceptance_k[p]
            if unseen:
                notes.append(f"versions {_pair(p)} ran k {_ks(unseen)} (cost windows) with no acceptance window at "
                             f"those ks: their acceptance comes from the positions measured at other ks")
        if self.cost_k:
            for p in sorted(set(self.acceptance_k) - set(self.cost_k)):
                notes.append(f"versions {_pair(p)} have acceptance windows but no cost windows: their traffic is not "
                             f"replayed (the tuned table covers them by its version wildcards). Missing: cost "
                             f"windows of {_pair(p)}; supply them with {COST_SOURCES}")
        return notes


def _pair(p: Pair) -> str:
    return f"{p[0]}|{p[1]}"


def _ks(ks: set[int]) -> str:
    return ", ".join(map(str, sorted(ks))) if ks else "none"


# ------------------------------------------------------------------------------------------------ study
def _storage(url: str) -> Any:
    import optuna

    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": 60}  # several processes share one SQLite file
    try:
        with warnings.catch_warnings():  # heartbeats are marked experimental; they are what fails dead trials
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S,
                                              grace_period=GRACE_S)
    except Exception as e:  # sqlalchemy / driver errors: name the URL (redacted) and what to check
        raise TuneError(f"cannot open the study storage {redact_url(url)}: {type(e).__name__}: {e}; check the URL "
                        "(sqlite:///FILE or postgresql+psycopg://USER@HOST/DB) and that the database is up") from e


def _constraints(trial: Any) -> Sequence[float]:
    return tuple(trial.user_attrs.get("constraint", (0.0,)))


def _has_set_constraint() -> bool:
    import optuna

    return hasattr(optuna.trial.Trial, "set_constraint")


def open_study(cfg: TuneConfig, space: Space) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress bar and the report say what happens
    # optuna 5 takes constraints from Trial.set_constraint (the objective sets it) and deprecates constraints_func;
    # optuna 4 has only constraints_func.
    old_api = cfg.p99_slo is not None and not _has_set_constraint()
    sampler = optuna.samplers.TPESampler(seed=cfg.seed, constraints_func=_constraints if old_api else None)
    study = optuna.create_study(study_name=cfg.study, storage=_storage(cfg.storage_url), sampler=sampler,
                                directions=cfg.directions, load_if_exists=True)
    meta: dict[str, Any] = {"target": cfg.target, "k_max": cfg.k_max, "directions": cfg.directions,
                            "params": space.names, "p99_slo": cfg.p99_slo,
                            "k_caps": [space.caps[c] for c in space.cells] if cfg.target == "table" else
                            space.k_limit}
    have = study.user_attrs.get(META)
    if have is None:
        study.set_user_attr(META, meta)
    else:
        diff = {k: (have.get(k), v) for k, v in meta.items() if k in have and have.get(k) != v}
        if diff:
            raise TuneError(f"study {cfg.study!r} was created for other settings ({diff}, as (study, this run)); "
                            "use the same arguments (and stored telemetry) to join it, or a new --study NAME")
    with warnings.catch_warnings():  # set_metric_names is marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(list(METRIC_NAMES[: len(cfg.directions)]))
    roles = {t.user_attrs.get(ROLE) for t in study.get_trials(deepcopy=False)}
    if "seed" not in roles:
        study.enqueue_trial(space.seed_params(), user_attrs={ROLE: "seed"}, skip_if_exists=False)
    model = space.model_params() if "model" not in roles else None
    if model is not None:
        study.enqueue_trial(model, user_attrs={ROLE: "model"}, skip_if_exists=False)
    return study


class StopOnSignal:
    """Stops a study on SIGINT or SIGTERM without leaving a trial RUNNING in its storage.

    optuna turns an exception raised in the objective into a FAIL trial, but one raised anywhere else in its loop
    (creating a trial, ``tell``, the heartbeat) leaves the trial RUNNING, or ends in its own ``UnboundLocalError``.
    So the first signal only asks to stop: the objective and a callback call ``study.stop()``, and optuna records
    the trial in flight and starts no other. A second signal raises ``KeyboardInterrupt``, but only while the
    objective runs, where optuna records the trial as FAIL. Installed only in the main thread (Python delivers
    signals there).
    """

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self.count = 0
        self.in_objective = False
        self.in_study = False  # inside study.optimize: a second signal waits for the objective
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    @property
    def requested(self) -> bool:
        return self.count > 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
        if self.count == 1:  # os.write: a print here could re-enter a write the main thread is in
            os.write(2, b"\nstopping after the trial in flight (again to stop it now)\n")
        elif self.in_objective or not self.in_study:
            raise KeyboardInterrupt

    def stop_if_requested(self, study: Any, trial: Any = None) -> None:
        if self.requested:
            study.stop()


def _objective(cfg: TuneConfig, space: Space, guard: StopOnSignal) -> Callable[[Any], Any]:
    def objective(trial: Any) -> Any:
        guard.in_objective = True
        try:
            guard.stop_if_requested(trial.study)
            s = score(cfg, space.replay, space.candidate(space.suggest(trial)), round_level=False,
                      k_limit=space.k_limit)
            trial.set_user_attr("tok_s", s.tok_s)
            trial.set_user_attr("p99_s", s.p99_s)
            if cfg.p99_slo is not None:
                trial.set_user_attr("constraint", [s.p99_s - cfg.p99_slo])  # feasible when <= 0
                if _has_set_constraint():
                    trial.set_constraint("p99_slo", s.p99_s - cfg.p99_slo)
            return (s.tok_s, s.p99_s) if cfg.latency_objective else s.tok_s
        finally:
            guard.in_objective = False
    return objective


def _feasible(cfg: TuneConfig, t: Any) -> bool:
    return cfg.p99_slo is None or all(c <= 0 for c in t.user_attrs.get("constraint", (0.0,)))


def best_trial(cfg: TuneConfig, study: Any) -> Any:
    """The feasible finished trial with the most tokens/s (on the Pareto front when multi-objective)."""
    from optuna.trial import TrialState

    pool = study.best_trials if cfg.latency_objective else study.get_trials(deepcopy=False,
                                                                             states=(TrialState.COMPLETE,))
    feasible = [t for t in pool if _feasible(cfg, t)]
    if not feasible:
        return None
    return max(feasible, key=lambda t: (t.values[0], t.user_attrs.get(ROLE) == "seed"))


def pareto_front(cfg: TuneConfig, study: Any, chosen: int | None) -> list[dict[str, Any]]:
    """The study's Pareto front (tokens/s up, p99 down), most tokens/s first."""
    front = sorted(study.best_trials, key=lambda t: (-t.values[0], t.values[1]))
    return [{"trial": t.number, METRIC_NAMES[0]: t.values[0], METRIC_NAMES[1]: t.values[1],
             "feasible": _feasible(cfg, t), "seed": t.user_attrs.get(ROLE) == "seed", "chosen": t.number == chosen}
            for t in front]


def run_optimisation(cfg: TuneConfig, study: Any, space: Space, say: Callable[[str], None],
                     guard: StopOnSignal | None = None) -> int:
    """Run trials until the study holds ``cfg.trials`` finished ones (or ``guard`` is signalled); returns how many
    this run added."""
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    guard = guard if guard is not None else StopOnSignal()
    done_states = (TrialState.COMPLETE, TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=done_states))
    todo = max(0, cfg.trials - done)
    if todo == 0:
        say(f"study {cfg.study!r} already holds {done} finished trials (--trials {cfg.trials}): nothing to run")
        return 0
    if guard.requested:
        return 0
    say(f"study {cfg.study!r}: {done} finished trials, running up to {todo} more")
    from rich.console import Console

    added = 0
    with Progress(TextColumn("[bold]tune[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), disable=not cfg.progress) as bar:
        task = bar.add_task("", total=cfg.trials, completed=done)

        def tick(st: Any, trial: Any) -> None:
            nonlocal added
            added += trial.state in done_states
            best = best_trial(cfg, st)
            desc = f"best {best.values[0]:.2f} tok/s" if best is not None else "no feasible trial yet"
            bar.update(task, completed=len(st.get_trials(deepcopy=False, states=done_states)), description=desc)

        guard.in_study = True
        try:
            study.optimize(_objective(cfg, space, guard), n_trials=todo, timeout=cfg.timeout_s,
                           gc_after_trial=False,
                           callbacks=[guard.stop_if_requested, MaxTrialsCallback(cfg.trials, states=done_states),
                                      tick])
        except KeyboardInterrupt:
            if not guard.requested:  # not ours: a KeyboardInterrupt raised by something else
                raise
        finally:
            guard.in_study = False
    return added


# ------------------------------------------------------------------------------------------------ plots
def write_plots(cfg: TuneConfig, study: Any, out: Path) -> tuple[list[str], list[str]]:
    """Optimisation history, Pareto front (multi-objective) and parameter importances as PNGs in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as ovm

    out.mkdir(parents=True, exist_ok=True)
    first: dict[str, Any] = {"target": lambda t: t.values[0], "target_name": "tok/s"} if cfg.latency_objective else {
        "target_name": "tok/s"}
    plots: list[tuple[str, Callable[[], Any]]] = [
        ("history.png", lambda: ovm.plot_optimization_history(study, **first)),
        # fANOVA: importance for the objective whichever its direction (optuna 5's default evaluator ranks
        # parameters by how they reach low values).
        ("importances.png", lambda: ovm.plot_param_importances(
            study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=cfg.seed), **first)),
    ]
    if cfg.latency_objective:
        plots.append(("pareto.png", lambda: ovm.plot_pareto_front(study, target_names=["tok/s", "p99 s/token"])))
    written, skipped = [], []
    for name, make in plots:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                ax = make()
            fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            written.append(str(out / name))
        except (ValueError, RuntimeError, ZeroDivisionError) as e:  # too few trials for importances, say
            skipped.append(f"{name}: {e}")
    return written, skipped


# ------------------------------------------------------------------------------------------------ run
def load_telemetry(cfg: TuneConfig) -> tuple[Slice, PolicyTable, str]:
    """All stored windows, the seed table and where it came from."""
    from telemetry.store import Store

    with Store(cfg.db_url) as store:
        acc = store.acceptance_windows()
        cost = store.cost_windows()
        latest = store.latest_policy_version() if cfg.seed_table is None else None
    if cfg.seed_table is not None:
        try:
            return Slice(tuple(acc), tuple(cost)), policy_table_from_json(cfg.seed_table.read_bytes()), str(
                cfg.seed_table)
        except (OSError, RecordError) as e:
            raise TuneError(f"--seed-table {cfg.seed_table}: {e}") from e
    if latest is not None:
        return Slice(tuple(acc), tuple(cost)), latest, f"latest published table v{latest.version}"
    static = PolicyTable(version=0, default_k=min(DEFAULT_SEED_K, cfg.k_max), k_max=cfg.k_max,
                         reason="static seed: no table published")
    return Slice(tuple(acc), tuple(cost)), static, f"static k={static.default_k} (no table published in the store)"


@dataclass(frozen=True)
class HeldOut:
    """The held-out slice, how much of it there is and whether it is enough for a verdict."""

    part: Slice
    windows: int  # engine windows (distinct engine, window end) of the slice's workload
    rows: int  # rows of acceptance windows
    cut: float | None  # end time from which windows are held out (None: nothing held out)
    why_not: str | None  # why there is no verdict (None: there is one)

    @property
    def enough(self) -> bool:
        return self.why_not is None

    def to_dict(self) -> dict[str, Any]:
        return {"windows": self.windows, "rows": self.rows, "min_windows": MIN_HELDOUT_WINDOWS,
                "min_rows": MIN_HELDOUT_ROWS, "verdict_possible": self.enough, "why_not": self.why_not}


def hold_out(cfg: TuneConfig, everything: Slice) -> tuple[Slice, HeldOut]:
    """(the slice to tune on, the held-out slice): see :func:`controller.offline.replay.split_by_time`. A held-out
    slice under :data:`MIN_HELDOUT_WINDOWS` engine windows or :data:`MIN_HELDOUT_ROWS` rows gives no verdict; one
    that cannot be split off at all leaves every window to tune on."""
    if cfg.holdout <= 0:
        return everything, HeldOut(Slice((), ()), 0, 0, None, "no held-out check (--holdout 0)")
    try:
        tune_part, held, cut = split_by_time(everything.acceptance, everything.cost, cfg.holdout)
    except ReplayError as e:
        return everything, HeldOut(Slice((), ()), 0, 0, None, f"not enough held-out data: {e}")
    rows = sum(w.window.rows for w in held.acceptance)
    n = len({(w.window_end, w.engine_id) for w in (held.cost or held.acceptance)})
    if not held.acceptance or not (held.cost or cfg.calibration is not None):
        why: str | None = (f"not enough held-out data ({n} windows, {rows} rows; the held-out windows lack "
                           f"{'acceptance' if not held.acceptance else 'cost'} windows)")
    elif n < MIN_HELDOUT_WINDOWS or rows < MIN_HELDOUT_ROWS:
        why = (f"not enough held-out data ({n} windows, need {MIN_HELDOUT_WINDOWS}; {rows} rows, need "
               f"{MIN_HELDOUT_ROWS})")
    else:
        why = None
    return tune_part, HeldOut(held, n, rows, cut, why)


def store_tuned(db_url: str, table: PolicyTable) -> tuple[PolicyTable, bool]:
    """Store ``table`` as the store's next policy version; returns (the table as stored, whether it is new). A
    table equal to the latest stored one (default, k_max, entries) is not stored again."""
    from telemetry.store import Store

    try:
        check_table_size(table)
    except RecordError as e:
        raise TuneError(f"the tuned table cannot be stored: {e}; pass --no-store and take the table from --out") from e
    with Store(db_url) as store:
        for _ in range(STORE_ATTEMPTS):
            latest = store.latest_policy_version()
            if latest is not None and (latest.default_k, latest.k_max, latest.entries) == (
                    table.default_k, table.k_max, table.entries):
                return latest, False
            stored = replace(table, version=max(table.version, latest.version + 1 if latest else 1),
                             created_at=time.time())
            try:
                store.save_policy_version(stored)
                return stored, True
            except StoreRejectedError:  # a sidecar took that version number meanwhile: take the next one
                continue
    raise TuneError(f"could not store the tuned table after {STORE_ATTEMPTS} attempts (other writers keep taking "
                    "the next policy version); rerun, or pass --no-store and keep --out's tuned_table.json")


def tune(cfg: TuneConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the study and the held-out check; returns the summary (also written to ``cfg.summary_json``).

    A SIGINT or SIGTERM during the study ends it early (see :class:`StopOnSignal`): the summary then says
    ``interrupted`` with the signal's number, and the table is not stored."""
    everything, seed_table, seed_from = load_telemetry(cfg)
    coverage_notes = Coverage.of(everything.acceptance, everything.cost).check(cfg.calibration)
    tune_part, held_out = hold_out(cfg, everything)
    cost = SweepCost(cfg.calibration, cfg.profile, cfg.k_max) if cfg.calibration is not None else None
    replay = build_replay(tune_part, cfg.k_max, cost, cfg.window_s)
    held = build_replay(held_out.part, cfg.k_max, cost, cfg.window_s) if held_out.enough else None
    space = Space(cfg, replay, seed_table)
    if not space.names:
        raise TuneError(f"no bucket holds {cfg.min_share:.1%} of the replayed windows: nothing to tune")
    say(f"replaying {replay.windows} windows to tune on" + (
        f", {held.windows} held out (ended at or after t={held_out.cut:.3f})" if held else "") +
        f"; {len(space.names)} parameters; seed: {seed_from}")
    cap_note = _cap_note(cfg, space)
    for note in (*coverage_notes, *replay.notes, *([cap_note] if cap_note else []),
                 *([held_out.why_not] if held_out.why_not and cfg.holdout > 0 else [])):
        say(f"note: {note}")
    with StopOnSignal() as guard:
        study = open_study(cfg, space)
        added = run_optimisation(cfg, study, space, say, guard)
        summary = _summarise(cfg, study, space, replay, held, held_out, everything, seed_table, seed_from, added,
                             guard, coverage_notes, cap_note, say)
    if cfg.summary_json is not None:
        cfg.summary_json.parent.mkdir(parents=True, exist_ok=True)
        cfg.summary_json.write_text(json.dumps(summary, indent=1, default=_json_default) + "\n")
    return summary


def _cap_note(cfg: TuneConfig, space: Space) -> str | None:
    if cfg.allow_extrapolation:
        deepest = space.replay.measured_k.get(("all",), 0)
        return (f"--allow-extrapolation: k searched up to --k-max {cfg.k_max}; acceptance past k {deepest} (the "
                "largest drafted) repeats the deepest position measured") if deepest < cfg.k_max else None
    if not space.capped:
        return None
    caps = sorted({space.caps[c] for c in space.cells} | {space.k_limit})
    by_cost = ""
    if space.cost_capped:
        cells = sorted(space.cost_capped, key=lambda c: (c[1], c[2], c[0]))
        shown = ", ".join(f"{rt} batch {bb} {ctx} k <= {space.caps[(rt, bb, ctx)]}" for rt, bb, ctx in cells[:6])
        more = f" and {len(cells) - 6} more" if len(cells) > 6 else ""
        by_cost = (f"; and at the deepest k whose round cost was measured at the bucket's batch or a larger one "
                   f"({shown}{more}): deeper, the cost is the model's guess across batch sizes")
    return (f"k capped at the largest k drafted in the acceptance windows (per request type and context bucket; "
            f"caps {', '.join(map(str, caps))} below --k-max {cfg.k_max}): past it acceptance is not measured"
            f"{by_cost}. Pass --allow-extrapolation to search up to --k-max anyway")


def _summarise(cfg: TuneConfig, study: Any, space: Space, replay: Replay, held: Replay | None, held_out: HeldOut,
               everything: Slice, seed_table: PolicyTable, seed_from: str, added: int, guard: StopOnSignal,
               coverage_notes: list[str], cap_note: str | None, say: Callable[[str], None]) -> dict[str, Any]:
    interrupted = guard.signum
    best = best_trial(cfg, study)
    if best is None:
        if interrupted is not None:
            raise TuneInterrupted(interrupted, f"interrupted before any trial of study {cfg.study!r} finished; rerun "
                                               "the same command to resume it")
        raise TuneError(f"no finished trial of study {cfg.study!r} meets --p99-slo {cfg.p99_slo}; relax the SLO or "
                        "run more trials")
    seed_c = Candidate(table=seed_table) if cfg.target == "table" else Candidate(params=goodput_defaults())
    reason = f"tuned by spectune tune study={cfg.study} trial={best.number}"
    tuned_c = space.candidate(best.params, note=reason)
    rows = {}
    for name, cand in (("seed", seed_c), ("tuned", tuned_c)):
        limit = space.k_limit
        pred = score(cfg, replay, cand, round_level=False, k_limit=limit)
        r: dict[str, Any] = {"predicted_tok_s": pred.tok_s, "predicted_p99_s": pred.p99_s}
        if held is not None:
            rep = score(cfg, held, cand, round_level=True, k_limit=limit)
            r.update(replayed_tok_s=rep.tok_s, replayed_p99_s=rep.p99_s)
            if cand.table is not None:
                an = held.score_table(cand.table)
                r.update(heldout_predicted_tok_s=an.tok_s, heldout_predicted_p99_s=an.p99_s)
        rows[name] = r
    summary: dict[str, Any] = {
        "study": cfg.study, "storage": redact_url(cfg.storage_url), "target": cfg.target,
        "directions": cfg.directions, "metric_names": list(METRIC_NAMES[: len(cfg.directions)]),
        "p99_slo_s": cfg.p99_slo, "trials": len(study.trials), "trials_added": added, "best_trial": best.number,
        "best_is_seed": best.user_attrs.get(ROLE) == "seed", "interrupted": interrupted is not None,
        "seed_from": seed_from, "cost": replay.notes[0],
        "windows": {"tune": replay.windows, "heldout": held.windows if held else 0,
                    "cut_time": held_out.cut if held else None},
        "heldout": held_out.to_dict(),
        "notes": [*coverage_notes, *replay.notes[1:], *([cap_note] if cap_note else [])],
        "k_space": {"k_max": cfg.k_max, "allow_extrapolation": cfg.allow_extrapolation,
                    "largest_k_measured": replay.measured_k.get(("all",)), "k_limit": space.k_limit,
                    "capped": space.capped},
        "seed": rows["seed"], "tuned": rows["tuned"],
        "predicted_gain": rows["tuned"]["predicted_tok_s"] / rows["seed"]["predicted_tok_s"] - 1.0,
    }
    if held is not None:
        gain = rows["tuned"]["replayed_tok_s"] / rows["seed"]["replayed_tok_s"] - 1.0
        summary.update(heldout_gain=gain, beats_seed_on_heldout=gain >= 0.0)
    if cfg.latency_objective:
        summary["pareto_front"] = pareto_front(cfg, study, best.number)
    if cfg.target == "table":
        assert tuned_c.table is not None
        table = tuned_c.table
        if cfg.store and guard.signum is None:  # a signal during the summary also keeps the table out
            table, new = store_tuned(cfg.db_url, table)
            summary["stored"] = {"db_url": redact_url(cfg.db_url), "version": table.version, "new": new}
        else:
            summary["stored"] = None
            summary["not_stored_because"] = "--no-store" if not cfg.store else (
                "interrupted: rerun the same command to finish the study and store its table")
        tuned_c = Candidate(table=table)
        summary["tuned_table"] = json.loads(table_to_json(table))
        seed_k = space.seed_params()
        summary["buckets"] = [{"request_type": c[0], "batch_bucket": c[1], "context_bucket": c[2],
                               "share": round(space.share[c], 4), "k_cap": space.caps[c],
                               "seed_k": lookup(seed_table, Bucket(*space.main_pair, c[0], c[1], c[2])),
                               "seed_k_searched": seed_k[space.param(c)],
                               "tuned_k": int(best.params[space.param(c)])} for c in space.cells]
        # The figure `spectune export --db-url` prints for this table, with the same cost source.
        whole = store_replay(everything, table.k_max, cfg.calibration, cfg.profile, cfg.window_s)
        summary["predicted_all_windows"] = {
            "windows": whole.windows, "cost": whole.notes[0],
            "seed_tok_s": whole.score_table(seed_table).tok_s, "tuned_tok_s": whole.score_table(table).tok_s,
            "export": _export_hint(cfg)}
    else:
        summary["seed_params"] = goodput_defaults()
        summary["tuned_params"] = dict(best.params)
    if cfg.out is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
        written, skipped = write_plots(cfg, study, cfg.out)
        summary["plots"], summary["plots_skipped"] = written, skipped
        if tuned_c.table is not None:
            (cfg.out / "tuned_table.json").write_text(table_to_json(tuned_c.table) + "\n")
    if guard.signum is not None:
        summary.update(interrupted=True, signal=guard.signum)
    return summary


def _export_hint(cfg: TuneConfig) -> str:
    cal = f" --calibration {cfg.calibration} --profile {cfg.profile}" if cfg.calibration is not None else ""
    return f"spectune export ENGINE --db-url {redact_url(cfg.db_url)}{cal}"


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON")


def report(summary: dict[str, Any]) -> None:
    """The tuned result beside the seed, with the predicted and held-out gains (and the Pareto front)."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if summary.get("interrupted"):
        con.print(f"[bold]interrupted[/] (signal {summary['signal']}): the study holds {summary['trials']} trials; "
                  "what its finished trials give so far:")
    if summary["target"] == "table":
        tab = Table(title="k per bucket: seed vs tuned (buckets of the replayed traffic)")
        for col in ("request type", "batch", "context", "share", "k cap", "seed k", "tuned k"):
            tab.add_column(col, justify="right" if col not in ("request type", "context") else "left")
        for b in summary["buckets"]:
            mark = "" if b["seed_k"] == b["tuned_k"] else " *"
            tab.add_row(b["request_type"], str(b["batch_bucket"]), b["context_bucket"], f"{b['share']:.1%}",
                        str(b["k_cap"]), str(b["seed_k"]), f"{b['tuned_k']}{mark}")
    else:
        tab = Table(title="GoodputPolicy hyper-parameters: defaults vs tuned")
        for col in ("parameter", "default", "tuned"):
            tab.add_column(col)
        for name, v in summary["seed_params"].items():
            t = summary["tuned_params"][name]
            tab.add_row(name, _fmt(v), _fmt(t))
    con.print(tab)
    if summary.get("pareto_front"):
        front = Table(title=f"Pareto front ({len(summary['pareto_front'])} trials: more tok/s costs p99 latency)")
        for col in ("trial", "tok/s", "p99 ms/token", "meets SLO", ""):
            front.add_column(col, justify="right")
        for p in summary["pareto_front"]:
            mark = "chosen" if p["chosen"] else ("seed" if p["seed"] else "")
            front.add_row(str(p["trial"]), f"{p[METRIC_NAMES[0]]:.2f}", f"{1e3 * p[METRIC_NAMES[1]]:.2f}",
                          "yes" if p["feasible"] else "no", mark)
        con.print(front)
    s, t = summary["seed"], summary["tuned"]
    con.print(f"predicted on the tuning windows: seed {s['predicted_tok_s']:.2f} tok/s (p99 "
              f"{1e3 * s['predicted_p99_s']:.2f} ms/token), tuned {t['predicted_tok_s']:.2f} tok/s (p99 "
              f"{1e3 * t['predicted_p99_s']:.2f} ms/token): {100 * summary['predicted_gain']:+.1f}%")
    h = summary["heldout"]
    if "heldout_gain" in summary:
        verdict = "beats the seed" if summary["heldout_gain"] > 0 else (
            "ties the seed" if summary["heldout_gain"] == 0 else "DOES NOT beat the seed")
        con.print(f"replayed on {summary['windows']['heldout']} held-out windows ({h['windows']} engine windows, "
                  f"{h['rows']} rows; not tuned on): seed {s['replayed_tok_s']:.2f} tok/s, tuned "
                  f"{t['replayed_tok_s']:.2f} tok/s: {100 * summary['heldout_gain']:+.1f}% — the tuned "
                  f"{summary['target']} {verdict}")
    elif h["why_not"]:
        con.print(f"no held-out verdict: {h['why_not']}")
    for note in summary.get("notes", []):
        if note.startswith(("k capped", "--allow-extrapolation")):
            con.print(f"note: {note}")
    whole = summary.get("predicted_all_windows")
    if whole:
        con.print(f"predicted over all {whole['windows']} stored windows ({whole['cost']}): seed "
                  f"{whole['seed_tok_s']:.2f} tok/s, tuned {whole['tuned_tok_s']:.2f} tok/s (what `{whole['export']}` "
                  "predicts for the full table)")
    stored = summary.get("stored")
    if stored:
        con.print(f"tuned table {'stored as' if stored['new'] else 'already stored as'} policy version "
                  f"v{stored['version']} in {stored['db_url']} (export reads it from there; a sidecar on this store "
                  "would follow it)")
    elif summary["target"] == "table":
        con.print(f"tuned table not stored: {summary['not_stored_because']}")
    for p in summary.get("plots", []):
        con.print(f"plot: {p}")
    for p in summary.get("plots_skipped", []):
        con.print(f"plot skipped: {p}")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# ------------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="spectune tune",
        description="Tune a static k table (or the goodput policy's hyper-parameters) with optuna by replaying the "
                    "telemetry stored in --db-url; the study lives in the same database. Watch it with "
                    "`optuna-dashboard DB_URL`.")
    ap.add_argument("--db-url", default=DEFAULT_DB_URL, help="the telemetry store (default %(default)s)")
    ap.add_argument("--storage", default=None, help="optuna study database (default: --db-url)")
    ap.add_argument("--study", default="spectune-tune", help="study name; processes with one name share it")
    ap.add_argument("--target", choices=TARGETS, default="table",
                    help="table: one k per (type, batch, context) bucket; goodput: GoodputPolicy hyper-parameters")
    ap.add_argument("--trials", type=int, default=50, help="the study's total of finished trials (resumes add "
                                                           "what is missing)")
    ap.add_argument("--seed", type=int, default=0, help="sampler and simulator seed (one per process sharing a "
                                                        "study)")
    ap.add_argument("--calibration", type=Path, default=None,
                    help="engine benchmark file for the cost (e.g. bench/results/engine.json); default: the cost "
                         "model fitted on stored cost windows")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help=f"the calibration's profile ({', '.join(PROFILE_NAMES)}"
                                                              "; default %(default)s)")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--holdout", type=float, default=DEFAULT_HOLDOUT,
                    help="share of stored windows, the latest, held out for the check (0: no check)")
    ap.add_argument("--latency-objective", action="store_true", help="also minimise p99 per-token latency (Pareto)")
    ap.add_argument("--p99-slo", type=float, default=None, metavar="S", help="constraint: p99 per-token latency <= S "
                                                                             "seconds")
    ap.add_argument("--seed-table", type=Path, default=None, help="policy table JSON to start from and beat "
                                                                  "(default: latest published in --db-url)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the plots and tuned_table.json")
    ap.add_argument("--summary-json", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=None, help="stop this run after this many seconds")
    ap.add_argument("--allow-extrapolation", action="store_true",
                    help="search k up to --k-max even past the largest k drafted in the acceptance windows (whose "
                         "acceptance is then extrapolated); by default k is capped there")
    ap.add_argument("--no-store", action="store_true",
                    help="do not store the tuned table as the next policy version of --db-url (by default it is, "
                         "so `spectune export --db-url` finds it)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: Sequence[str]) -> int:
    """``spectune tune ARGS``; expected failures raise :class:`TuneError` (printed as ``error:``, status 2). A run
    a signal stopped prints what the study holds and returns 128 + the signal's number (130 for Ctrl-C)."""
    args = build_parser().parse_args(list(argv))
    cfg = TuneConfig(db_url=args.db_url, storage=args.storage, study=args.study, target=args.target,
                     trials=args.trials, seed=args.seed, calibration=args.calibration, profile=args.profile,
                     k_max=args.k_max, holdout=args.holdout, latency_objective=args.latency_objective,
                     p99_slo=args.p99_slo, seed_table=args.seed_table, out=args.out, summary_json=args.summary_json,
                     timeout_s=args.timeout, progress=not args.no_progress and sys.stderr.isatty(),
                     allow_extrapolation=args.allow_extrapolation, store=not args.no_store)
    try:
        summary = tune(cfg, say=lambda line: print(line, file=sys.stderr))
    except ReplayError as e:
        raise TuneError(str(e)) from e
    except TuneInterrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return EXIT_SIGNAL_BASE + e.signum
    report(summary)
    return EXIT_SIGNAL_BASE + summary["signal"] if summary["interrupted"] else 0


__all__ = ["TuneConfig", "TuneError", "TuneInterrupted", "main", "tune"]
