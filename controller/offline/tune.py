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
round-level replay (acceptance and, without ``--calibration``, cost learnt from the held-out windows alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from controller.offline.replay import (
    Replay,
    ReplayError,
    Score,
    Slice,
    SweepCost,
    TablePolicy,
    build_replay,
    split_by_time,
)
from engine.profiles import PROFILE_NAMES
from telemetry.errors import SpectuneError
from telemetry.policy_table import lookup, policy_table_from_json, table_to_json
from telemetry.records import MAX_DRAFT_LEN, WILDCARD, Bucket, PolicyTable, RecordError
from telemetry.store import DEFAULT_DB_URL
from telemetry.urls import redact_url

TARGETS = ("table", "goodput")
DEFAULT_PROFILE = "xl"  # the large model's cost: where the choice of k matters most
DEFAULT_SEED_K = 3  # seed table when none is published nor given (StaticPolicy's default k)
DEFAULT_HOLDOUT = 0.3
MIN_SHARE = 0.005  # buckets with less of the replayed windows keep the seed's k (see the module docstring)
HEARTBEAT_S = 10  # a trial whose process died is failed after GRACE_S without a heartbeat
GRACE_S = 30
ROLE = "spectune_role"  # user attribute marking the seed trial
META = "spectune"  # study user attribute: what the study tunes (checked when a run joins it)
# GoodputPolicy hyper-parameters tuned, with their ranges: (low, high, kind).
GOODPUT_SPACE: dict[str, tuple[float, float, str]] = {
    "switch_margin": (0.0, 0.2, "float"),
    "off_margin": (0.0, 0.3, "float"),
    "hold_decisions": (0, 10, "int"),
    "explore_radius": (1, 4, "int"),
    "prior_mean": (0.2, 0.9, "float"),
    "probe_every": (10, 200, "int"),
}


class TuneError(SpectuneError):
    """A bad argument or a study that cannot go on; the message says what to do."""


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
    """The search space of a target and how a trial's parameters become a candidate."""

    def __init__(self, cfg: TuneConfig, replay: Replay, seed_table: PolicyTable) -> None:
        self.cfg, self.replay, self.seed_table = cfg, replay, seed_table
        self.cells: list[tuple[str, int, str]] = []  # (request type, batch bucket, context bucket)
        if cfg.target == "table":
            share: dict[tuple[str, int, str], float] = {}
            n = replay.windows
            for spec, bb in zip(replay.load.specs, replay.load.buckets, strict=True):
                for rt, w in zip(replay.load.types, spec.mix, strict=True):
                    share[(rt, bb, spec.context)] = share.get((rt, bb, spec.context), 0.0) + w / n
            self.share = share
            self.cells = sorted(c for c, s in share.items() if s >= cfg.min_share)
            self.pairs = sorted(set(replay.load.pair_of.values()))
            self.main_pair = max(self.pairs, key=lambda p: sum(
                1 for s in replay.load.specs if replay.load.pair_of[s.version] == p))

    @staticmethod
    def param(cell: tuple[str, int, str]) -> str:
        return f"k:{cell[0]}|{cell[1]}|{cell[2]}"

    @property
    def names(self) -> list[str]:
        return [self.param(c) for c in self.cells] if self.cfg.target == "table" else list(GOODPUT_SPACE)

    def suggest(self, trial: Any) -> dict[str, Any]:
        if self.cfg.target == "table":
            return {self.param(c): trial.suggest_int(self.param(c), 0, self.cfg.k_max) for c in self.cells}
        out: dict[str, Any] = {}
        for name, (lo, hi, kind) in GOODPUT_SPACE.items():
            out[name] = trial.suggest_int(name, int(lo), int(hi)) if kind == "int" else trial.suggest_float(
                name, lo, hi)
        return out

    def seed_params(self) -> dict[str, Any]:
        """The seed as trial parameters: the seed table's k per tuned bucket, or GoodputPolicy's defaults."""
        if self.cfg.target == "table":
            t, d = self.main_pair
            return {self.param(c): min(lookup(self.seed_table, Bucket(t, d, c[0], c[1], c[2])), self.cfg.k_max)
                    for c in self.cells}
        return dict(goodput_defaults())

    def candidate(self, params: dict[str, Any], note: str = "") -> Candidate:
        if self.cfg.target == "goodput":
            return Candidate(params=dict(params))
        base = self.seed_table
        entries = dict(base.entries)
        for c in self.cells:
            k = int(params[self.param(c)])
            # Exact keys for every version pair seen (they outrank the seed's broader keys), and version
            # wildcards for versions the tuning data did not see (a model update).
            for t, d in self.pairs:
                entries[Bucket(t, d, c[0], c[1], c[2]).key()] = k
            entries["|".join((WILDCARD, WILDCARD, c[0], str(c[1]), c[2]))] = k
        table = PolicyTable(version=base.version + 1, default_k=min(base.default_k, self.cfg.k_max),
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


def score(cfg: TuneConfig, replay: Replay, cand: Candidate, round_level: bool) -> Score:
    """Analytic (tables) or round-level (``round_level``, and always for the goodput policy) replay."""
    if cand.table is not None:
        if not round_level:
            return replay.score_table(cand.table)
        return replay.simulate(TablePolicy(cand.table, replay.load.pair_of, cfg.k_max), seed=cfg.seed, noise=cfg.noise)
    from policies.goodput import GoodputPolicy

    return replay.simulate(GoodputPolicy(k_max=cfg.k_max, seed=cfg.seed, **cand.params), seed=cfg.seed,
                           noise=cfg.noise)


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
    meta = {"target": cfg.target, "k_max": cfg.k_max, "directions": cfg.directions, "params": space.names,
            "p99_slo": cfg.p99_slo}
    have = study.user_attrs.get(META)
    if have is None:
        study.set_user_attr(META, meta)
    elif have != meta:
        diff = {k: (have.get(k), v) for k, v in meta.items() if have.get(k) != v}
        raise TuneError(f"study {cfg.study!r} was created for other settings ({diff}, as (study, this run)); "
                        "use the same arguments to join it, or a new --study NAME")
    if not any(t.user_attrs.get(ROLE) == "seed" for t in study.get_trials(deepcopy=False)):
        study.enqueue_trial(space.seed_params(), user_attrs={ROLE: "seed"})
    return study


def _objective(cfg: TuneConfig, space: Space) -> Callable[[Any], Any]:
    def objective(trial: Any) -> Any:
        s = score(cfg, space.replay, space.candidate(space.suggest(trial)), round_level=False)
        trial.set_user_attr("tok_s", s.tok_s)
        trial.set_user_attr("p99_s", s.p99_s)
        if cfg.p99_slo is not None:
            trial.set_user_attr("constraint", [s.p99_s - cfg.p99_slo])  # feasible when <= 0
            if _has_set_constraint():
                trial.set_constraint("p99_slo", s.p99_s - cfg.p99_slo)
        return (s.tok_s, s.p99_s) if cfg.latency_objective else s.tok_s
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


def run_optimisation(cfg: TuneConfig, study: Any, space: Space, say: Callable[[str], None]) -> int:
    """Run trials until the study holds ``cfg.trials`` finished ones; returns how many this run added."""
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    done_states = (TrialState.COMPLETE, TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=done_states))
    todo = max(0, cfg.trials - done)
    if todo == 0:
        say(f"study {cfg.study!r} already holds {done} finished trials (--trials {cfg.trials}): nothing to run")
        return 0
    say(f"study {cfg.study!r}: {done} finished trials, running up to {todo} more")
    from rich.console import Console

    added = 0
    with Progress(TextColumn("[bold]tune[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), disable=not cfg.progress) as bar:
        task = bar.add_task("", total=cfg.trials, completed=done)

        def tick(st: Any, trial: Any) -> None:
            nonlocal added
            added += 1
            best = best_trial(cfg, st)
            desc = f"best {best.values[0]:.2f} tok/s" if best is not None else "no feasible trial yet"
            bar.update(task, completed=len(st.get_trials(deepcopy=False, states=done_states)), description=desc)

        study.optimize(_objective(cfg, space), n_trials=todo, timeout=cfg.timeout_s, gc_after_trial=False,
                       callbacks=[MaxTrialsCallback(cfg.trials, states=done_states), tick])
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


def tune(cfg: TuneConfig, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the study and the held-out check; returns the summary (also written to ``cfg.summary_json``)."""
    everything, seed_table, seed_from = load_telemetry(cfg)
    tune_part, held_part, cut = split_by_time(everything.acceptance, everything.cost, cfg.holdout)
    cost = SweepCost(cfg.calibration, cfg.profile, cfg.k_max) if cfg.calibration is not None else None
    replay = build_replay(tune_part, cfg.k_max, cost, cfg.window_s)
    held = build_replay(held_part, cfg.k_max, cost, cfg.window_s) if cfg.holdout > 0 else None
    space = Space(cfg, replay, seed_table)
    if not space.names:
        raise TuneError(f"no bucket holds {cfg.min_share:.1%} of the replayed windows: nothing to tune")
    say(f"replaying {replay.windows} windows to tune on" + (f", {held.windows} held out (ended at or after "
                                                             f"t={cut:.3f})" if held else "") +
        f"; {len(space.names)} parameters; seed: {seed_from}")
    for note in replay.notes:
        say(f"note: {note}")
    study = open_study(cfg, space)
    added = run_optimisation(cfg, study, space, say)
    best = best_trial(cfg, study)
    if best is None:
        raise TuneError(f"no finished trial of study {cfg.study!r} meets --p99-slo {cfg.p99_slo}; relax the SLO or "
                        "run more trials")
    seed_c = Candidate(table=seed_table) if cfg.target == "table" else Candidate(params=goodput_defaults())
    tuned_c = space.candidate(best.params, note=f"spectune tune: study {cfg.study}, trial {best.number}")
    rows = {}
    for name, cand in (("seed", seed_c), ("tuned", tuned_c)):
        pred = score(cfg, replay, cand, round_level=False)
        r: dict[str, Any] = {"predicted_tok_s": pred.tok_s, "predicted_p99_s": pred.p99_s}
        if held is not None:
            rep = score(cfg, held, cand, round_level=True)
            r.update(replayed_tok_s=rep.tok_s, replayed_p99_s=rep.p99_s)
            if cand.table is not None:
                an = held.score_table(cand.table)
                r.update(heldout_predicted_tok_s=an.tok_s, heldout_predicted_p99_s=an.p99_s)
        rows[name] = r
    summary: dict[str, Any] = {
        "study": cfg.study, "storage": redact_url(cfg.storage_url), "target": cfg.target,
        "directions": cfg.directions, "p99_slo_s": cfg.p99_slo,
        "trials": len(study.trials), "trials_added": added, "best_trial": best.number,
        "best_is_seed": best.user_attrs.get(ROLE) == "seed",
        "seed_from": seed_from, "cost": replay.notes[0],
        "windows": {"tune": replay.windows, "heldout": held.windows if held else 0, "cut_time": cut if held else None},
        "notes": list(replay.notes[1:]),
        "seed": rows["seed"], "tuned": rows["tuned"],
        "predicted_gain": rows["tuned"]["predicted_tok_s"] / rows["seed"]["predicted_tok_s"] - 1.0,
    }
    if held is not None:
        gain = rows["tuned"]["replayed_tok_s"] / rows["seed"]["replayed_tok_s"] - 1.0
        summary.update(heldout_gain=gain, beats_seed_on_heldout=gain >= 0.0)
    if cfg.target == "table":
        assert tuned_c.table is not None
        summary["tuned_table"] = json.loads(table_to_json(tuned_c.table))
        summary["buckets"] = [{"request_type": c[0], "batch_bucket": c[1], "context_bucket": c[2],
                               "share": round(space.share[c], 4), "seed_k": space.seed_params()[space.param(c)],
                               "tuned_k": int(best.params[space.param(c)])} for c in space.cells]
    else:
        summary["seed_params"] = goodput_defaults()
        summary["tuned_params"] = dict(best.params)
    if cfg.out is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
        written, skipped = write_plots(cfg, study, cfg.out)
        summary["plots"], summary["plots_skipped"] = written, skipped
        if cfg.target == "table":
            assert tuned_c.table is not None
            (cfg.out / "tuned_table.json").write_text(table_to_json(tuned_c.table) + "\n")
    if cfg.summary_json is not None:
        cfg.summary_json.parent.mkdir(parents=True, exist_ok=True)
        cfg.summary_json.write_text(json.dumps(summary, indent=1, default=_json_default) + "\n")
    return summary


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON")


def report(summary: dict[str, Any]) -> None:
    """The tuned result beside the seed, with the predicted and held-out gains."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if summary["target"] == "table":
        tab = Table(title="k per bucket: seed vs tuned (buckets of the replayed traffic)")
        for col in ("request type", "batch", "context", "share", "seed k", "tuned k"):
            tab.add_column(col, justify="right" if col not in ("request type", "context") else "left")
        for b in summary["buckets"]:
            mark = "" if b["seed_k"] == b["tuned_k"] else " *"
            tab.add_row(b["request_type"], str(b["batch_bucket"]), b["context_bucket"], f"{b['share']:.1%}",
                        str(b["seed_k"]), f"{b['tuned_k']}{mark}")
    else:
        tab = Table(title="GoodputPolicy hyper-parameters: defaults vs tuned")
        for col in ("parameter", "default", "tuned"):
            tab.add_column(col)
        for name, v in summary["seed_params"].items():
            t = summary["tuned_params"][name]
            tab.add_row(name, _fmt(v), _fmt(t))
    con.print(tab)
    s, t = summary["seed"], summary["tuned"]
    con.print(f"predicted on the tuning windows: seed {s['predicted_tok_s']:.2f} tok/s (p99 "
              f"{1e3 * s['predicted_p99_s']:.2f} ms/token), tuned {t['predicted_tok_s']:.2f} tok/s (p99 "
              f"{1e3 * t['predicted_p99_s']:.2f} ms/token): {100 * summary['predicted_gain']:+.1f}%")
    if "heldout_gain" in summary:
        verdict = "beats the seed" if summary["heldout_gain"] > 0 else (
            "ties the seed" if summary["heldout_gain"] == 0 else "DOES NOT beat the seed")
        con.print(f"replayed on {summary['windows']['heldout']} held-out windows (not tuned on): seed "
                  f"{s['replayed_tok_s']:.2f} tok/s, tuned {t['replayed_tok_s']:.2f} tok/s: "
                  f"{100 * summary['heldout_gain']:+.1f}% — the tuned {summary['target']} {verdict}")
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
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: Sequence[str]) -> int:
    """``spectune tune ARGS``; expected failures raise :class:`TuneError` (printed as ``error:``, status 2)."""
    args = build_parser().parse_args(list(argv))
    cfg = TuneConfig(db_url=args.db_url, storage=args.storage, study=args.study, target=args.target,
                     trials=args.trials, seed=args.seed, calibration=args.calibration, profile=args.profile,
                     k_max=args.k_max, holdout=args.holdout, latency_objective=args.latency_objective,
                     p99_slo=args.p99_slo, seed_table=args.seed_table, out=args.out, summary_json=args.summary_json,
                     timeout_s=args.timeout, progress=not args.no_progress and sys.stderr.isatty())
    try:
        summary = tune(cfg, say=lambda line: print(line, file=sys.stderr))
    except ReplayError as e:
        raise TuneError(str(e)) from e
    report(summary)
    return 0


__all__ = ["TuneConfig", "TuneError", "main", "tune"]
