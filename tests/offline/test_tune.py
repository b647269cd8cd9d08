"""``spectune tune``: replay of stored telemetry, optuna studies on SQLite and PostgreSQL, held-out check."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from controller.cli import main as cli_main
from controller.offline.replay import ReplayError, build_replay, split_by_time
from controller.offline.tune import TuneConfig, TuneError, tune
from telemetry.aggregate import aggregate
from telemetry.records import PolicyTable, WindowBatch
from telemetry.store import Store
from telemetry.synthetic import SyntheticConfig, synthetic_rounds
from tests.offline.test_offline_export import non_increasing_schedules

BATCHES = (1, 4, 16)  # the loads the synthetic engine serves, a few windows each
ROUNDS_PER_WINDOW = 12
SEED_K = 1  # the "production" table: k = 1 everywhere, well short of what code and structured accept


def store_synthetic(url: str, windows: int = 60, seed: int = 0) -> None:
    """Seeded synthetic telemetry through the Store's public API, and a published static table (k = SEED_K)."""
    batches = []
    for i in range(windows):
        bs = BATCHES[(i // 4) % len(BATCHES)]
        cfg = SyntheticConfig(batch_sizes=(bs,), ks=(0, 1, 2, 3, 4), max_context=1500 if i % 8 < 5 else 6000)
        rounds = list(synthetic_rounds(ROUNDS_PER_WINDOW, seed=seed * 10_000 + i, config=cfg))
        agg = aggregate(rounds)
        batches.append(WindowBatch(engine_id="eng-1", seq=i, window_start=float(i), window_end=float(i) + 0.5,
                                   acceptance=agg.acceptance, cost=agg.cost))
    with Store(url, auto_upgrade=True) as store:
        store.ingest(batches)
        store.save_policy_version(PolicyTable(version=1, default_k=SEED_K, k_max=8, reason="static production"))


@pytest.fixture
def telemetry_url(sqlite_url: str) -> str:
    store_synthetic(sqlite_url)
    return sqlite_url


def _cfg(url: str, tmp_path: Path, **kw: object) -> TuneConfig:
    base: dict[str, object] = {"db_url": url, "study": f"t-{uuid.uuid4().hex[:8]}", "trials": 20, "seed": 3,
                               "progress": False, "k_max": 6}
    base.update(kw)
    return TuneConfig(**base)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ replay
def test_split_by_time_keeps_the_latest_windows_out(telemetry_url: str) -> None:
    with Store(telemetry_url) as store:
        acc, cost = store.acceptance_windows(), store.cost_windows()
    tune_part, held, cut = split_by_time(acc, cost, 0.3)
    assert max(w.window_end for w in tune_part.cost) < cut <= min(w.window_end for w in held.cost)
    assert len(tune_part.cost) + len(held.cost) == len(cost)
    assert len(tune_part.acceptance) + len(held.acceptance) == len(acc)
    ends = {w.window_end for w in cost}
    assert abs(len({w.window_end for w in held.cost}) / len(ends) - 0.3) < 0.05


def test_replay_prefers_deeper_drafts_where_they_pay(telemetry_url: str) -> None:
    """The synthetic engine accepts structured rows at 0.9: at batch 1 drafting 4 beats 1 and 0."""
    with Store(telemetry_url) as store:
        acc, cost = store.acceptance_windows(), store.cost_windows()
    tune_part, _, _ = split_by_time(acc, cost, 0.3)
    rep = build_replay(tune_part, 6, None, 0.5)
    by_k = {k: PolicyTable(version=1, default_k=k, k_max=8) for k in (0, 1, 4)}
    tok = {k: rep.score_table(t).tok_s for k, t in by_k.items()}
    assert tok[4] > tok[1] > tok[0]
    assert rep.score_table(by_k[4]).p99_s > rep.score_table(by_k[0]).p99_s  # longer rounds, per token too


def test_replay_with_a_recorded_sweep(telemetry_url: str, tmp_path: Path) -> None:
    fixture = Path(__file__).parents[1] / "policies" / "fixture_engine.json"
    s = tune(_cfg(telemetry_url, tmp_path, calibration=fixture, profile="small", trials=3, holdout=0.0))
    assert s["cost"].startswith(f"recorded sweep {fixture}")
    assert s["windows"]["heldout"] == 0 and "heldout_gain" not in s
    assert s["tuned"]["predicted_tok_s"] >= s["seed"]["predicted_tok_s"]


# ------------------------------------------------------------------------------------------------ tune
def test_tuned_table_beats_the_seed_on_held_out_telemetry(telemetry_url: str, tmp_path: Path) -> None:
    import optuna

    out, summary_path = tmp_path / "out", tmp_path / "summary.json"
    cfg = _cfg(telemetry_url, tmp_path, trials=15, out=out, summary_json=summary_path)
    s = tune(cfg)
    assert json.loads(summary_path.read_text())["tuned"] == s["tuned"]
    assert s["seed_from"] == "latest published table v1"
    # The seed trial is the published table, projected onto the tuned buckets.
    study = optuna.load_study(study_name=cfg.study, storage=telemetry_url)
    assert len(study.trials) == 15
    assert set(study.trials[0].params.values()) == {SEED_K}
    assert study.trials[0].value == pytest.approx(s["seed"]["predicted_tok_s"])
    # Tuned on the first 70% of windows; replayed on the last 30% it was never shown.
    assert s["tuned"]["predicted_tok_s"] > s["seed"]["predicted_tok_s"]
    assert s["tuned"]["replayed_tok_s"] >= s["seed"]["replayed_tok_s"]
    assert s["beats_seed_on_heldout"] is True
    tuned = json.loads((out / "tuned_table.json").read_text())
    assert tuned["version"] == 2 and tuned["entries"]
    assert {Path(p).name for p in s["plots"]} == {"history.png", "importances.png"}


def test_a_study_resumes_and_a_dead_trial_does_not_block_it(telemetry_url: str, tmp_path: Path) -> None:
    import optuna

    cfg = _cfg(telemetry_url, tmp_path, trials=4, holdout=0.0)
    assert tune(cfg)["trials_added"] == 4
    study = optuna.load_study(study_name=cfg.study, storage=telemetry_url)
    study.ask()  # a process that died mid-trial leaves it RUNNING
    s = tune(TuneConfig(**{**cfg.__dict__, "trials": 7}))
    assert s["trials_added"] == 3
    trials = optuna.load_study(study_name=cfg.study, storage=telemetry_url).trials
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 7
    assert sum(t.user_attrs.get("spectune_role") == "seed" for t in trials) == 1  # enqueued once
    assert tune(cfg)["trials_added"] == 0  # a finished study runs nothing more


def test_study_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    import optuna

    store_synthetic(pg_url, windows=40)
    cfg = _cfg(pg_url, tmp_path, trials=4, study=f"pg-{uuid.uuid4().hex[:8]}")
    s = tune(cfg)
    assert s["storage"].startswith("postgresql+psycopg://")
    assert len(optuna.load_study(study_name=cfg.study, storage=pg_url).trials) == 4
    assert s["tuned"]["replayed_tok_s"] >= s["seed"]["replayed_tok_s"] * 0.98  # 4 trials: no worse than noise


def test_latency_objective_with_an_slo(telemetry_url: str, tmp_path: Path) -> None:
    import optuna

    slo = 0.012  # seconds per token: the seed (k = 1) meets it; the deepest drafts do not
    cfg = _cfg(telemetry_url, tmp_path, trials=12, latency_objective=True, p99_slo=slo, out=tmp_path / "o",
               holdout=0.0)
    s = tune(cfg)
    assert s["directions"] == ["maximize", "minimize"]
    assert s["tuned"]["predicted_p99_s"] <= slo
    assert s["tuned"]["predicted_tok_s"] >= s["seed"]["predicted_tok_s"]
    assert "pareto.png" in {Path(p).name for p in s["plots"]}
    study = optuna.load_study(study_name=cfg.study, storage=telemetry_url)
    assert len(study.directions) == 2


def test_goodput_hyper_parameters(telemetry_url: str, tmp_path: Path) -> None:
    s = tune(_cfg(telemetry_url, tmp_path, target="goodput", trials=2))
    assert set(s["tuned_params"]) == set(s["seed_params"]) >= {"switch_margin", "hold_decisions", "prior_mean"}
    assert s["seed"]["replayed_tok_s"] > 0 and s["tuned"]["replayed_tok_s"] > 0
    assert s["tuned"]["predicted_tok_s"] >= s["seed"]["predicted_tok_s"]


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(("argv", "message"), [
    (["--trials", "0"], "--trials must be >= 1"),
    (["--holdout", "1.5"], "--holdout must be in [0, 1)"),
    (["--k-max", "40"], "--k-max must be in [1, 16]"),
    (["--p99-slo", "-1"], "--p99-slo must be > 0"),
    (["--calibration", "/nonexistent/engine.json"], "--calibration /nonexistent/engine.json is not a file"),
])
def test_bad_arguments_are_clear_errors(argv: list[str], message: str, telemetry_url: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["tune", "--db-url", telemetry_url, "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_argparse_rejects_an_unknown_target(telemetry_url: str) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["tune", "--db-url", telemetry_url, "--target", "nope"])
    assert e.value.code == 2


def test_empty_store_and_a_changed_study_are_refused(sqlite_url: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    Store(sqlite_url, auto_upgrade=True).close()
    assert cli_main(["tune", "--db-url", sqlite_url]) == 2
    assert "no cost windows stored" in capsys.readouterr().err
    store_synthetic(sqlite_url, windows=30)
    cfg = _cfg(sqlite_url, tmp_path, trials=2, holdout=0.0)
    tune(cfg)
    with pytest.raises(TuneError, match="was created for other settings"):
        tune(TuneConfig(**{**cfg.__dict__, "k_max": 4}))
    with pytest.raises(ReplayError, match="cannot be split"), Store(sqlite_url) as store:
        split_by_time(store.acceptance_windows(), store.cost_windows()[:1], 0.3)


def test_best_schedule_is_the_replay_best_schedule_that_never_drafts_deeper_at_a_larger_batch(
        sqlite_url: str) -> None:
    # The batch-size-only projection (vLLM / TensorRT-LLM schedules) is scored by the replay's packed-round cost:
    # its k never rises with batch size, and no other such schedule over the table's ks replays faster.
    store_synthetic(sqlite_url)
    with Store(sqlite_url) as store:
        acc, cost = store.acceptance_windows(), store.cost_windows()
    rep = build_replay(split_by_time(acc, cost, 0.0)[0], 8, None, 0.5)
    ks = {"code": 1, "prose": 2, "structured": 4}
    cells = {(bb, spec.context) for spec, bb in zip(rep.load.specs, rep.load.buckets, strict=True)}
    table = PolicyTable(version=2, default_k=2, k_max=8,
                        entries={f"*|*|{rt}|{bb}|{ctx}": k for rt, k in ks.items() for bb, ctx in cells})
    schedule = rep.best_schedule(table)
    assert set(schedule) == set(rep.load.buckets) and set(schedule.values()) <= set(ks.values())
    order = sorted(schedule)
    assert [schedule[b] for b in order] == sorted(schedule.values(), reverse=True)

    def score(sched: dict[int, int]) -> float:
        return rep.score(lambda spec, bb: (sched[bb],) * len(rep.load.types)).tok_s

    best = score(schedule)
    assert all(score(o) <= best + 1e-9 for o in non_increasing_schedules(order, sorted(set(ks.values()))))
    by_ctx = rep.best_schedule(table, by_context=True)
    assert {bb for bb, _ in by_ctx} == set(schedule)


def _table_of(best: dict[tuple[str, int, str], int]) -> PolicyTable:
    return PolicyTable(version=2, default_k=1, k_max=8,
                       entries={f"*|*|{rt}|{bb}|{ctx}": k for (rt, bb, ctx), k in best.items()})


def test_best_per_cell_is_the_replays_own_optimum(sqlite_url: str) -> None:
    # Searched cell by cell (the objective separates by cost cell): no single bucket's change replays faster,
    # and coordinate ascent (the path for many types) lands no higher than the exhaustive search.
    store_synthetic(sqlite_url)
    with Store(sqlite_url) as store:
        acc, cost = store.acceptance_windows(), store.cost_windows()
    rep = build_replay(split_by_time(acc, cost, 0.0)[0], 6, None, 0.5)
    caps = {(rt, bb, spec.context): 4 for spec, bb in zip(rep.load.specs, rep.load.buckets, strict=True)
            for rt, w in zip(rep.load.types, spec.mix, strict=True) if w > 0}
    base = rep.table_ks(PolicyTable(version=1, default_k=SEED_K, k_max=8))
    best = rep.best_per_cell(caps, base)
    assert set(best) == set(caps) and all(0 <= k <= 4 for k in best.values())
    top = rep.score_table(_table_of(best)).tok_s
    assert top > rep.score_table(PolicyTable(version=1, default_k=SEED_K, k_max=8)).tok_s
    for cell in best:
        for k in range(5):
            assert rep.score_table(_table_of({**best, cell: k})).tok_s <= top + 1e-9, (cell, k)
    ascent = rep.best_per_cell(caps, base, max_combos=1)
    assert rep.score_table(_table_of(ascent)).tok_s <= top + 1e-9


def test_the_models_best_table_is_a_trial_and_the_tuned_table_is_no_worse(telemetry_url: str,
                                                                           tmp_path: Path) -> None:
    import optuna

    cfg = _cfg(telemetry_url, tmp_path, trials=6, holdout=0.0)
    s = tune(cfg)
    study = optuna.load_study(study_name=cfg.study, storage=telemetry_url)
    roles = [t.user_attrs.get("spectune_role") for t in study.trials]
    assert roles[:2] == ["seed", "model"]
    model = study.trials[1]
    assert model.value > study.trials[0].value
    assert s["tuned"]["predicted_tok_s"] >= model.value - 1e-9
    tune(TuneConfig(**{**cfg.__dict__, "trials": 8}))  # resumed: the model trial is not enqueued twice
    roles = [t.user_attrs.get("spectune_role") for t in optuna.load_study(study_name=cfg.study,
                                                                         storage=telemetry_url).trials]
    assert roles.count("model") == 1 and len(roles) == 8
