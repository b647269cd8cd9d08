"""``spectune tune`` says what it cannot know: missing telemetry named, no k past the measured ones, no held-out
verdict on too little data, a clean stop on a signal, the Pareto front everywhere, and the same prediction as
``spectune export`` for the table it stores."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from controller.cli import main as cli_main
from controller.offline import project as pj
from controller.offline.replay import split_by_time
from controller.offline.tune import MIN_HELDOUT_WINDOWS, TuneConfig, TuneError, tune
from telemetry.records import AcceptanceWindow, CostWindow, Stat, WindowBatch
from telemetry.store import Store
from tests.offline.test_tune import store_synthetic

CALIBRATION = Path(__file__).parents[1] / "policies" / "fixture_engine.json"  # a recorded sweep, k up to 8
REPO = Path(__file__).parents[2]
DEADLINE_S = 60.0  # generous: a loaded 2-core machine; polls return as soon as the condition holds
POLL_S = 0.05


def _cfg(url: str, **kw: object) -> TuneConfig:
    base: dict[str, object] = {"db_url": url, "study": f"h-{uuid.uuid4().hex[:8]}", "trials": 6, "seed": 3,
                               "progress": False, "k_max": 6}
    base.update(kw)
    return TuneConfig(**base)  # type: ignore[arg-type]


def _acc(k: int, rows: int, hist: tuple[int, ...], model: str = "m", rt: str = "unknown") -> AcceptanceWindow:
    accepted = sum(i * h for i, h in enumerate(hist))
    return AcceptanceWindow(target_version=model, draft_version="unknown", request_type=rt,
                            context_bucket="unknown", k=k, rows=rows, drafted=rows * k, accepted=accepted,
                            emitted=accepted + rows, hist=hist)


def _cost(k: int, batch: int, model: str = "m") -> CostWindow:
    s = 0.02 + 0.002 * k * batch ** 0.5
    return CostWindow(target_version=model, draft_version="unknown", batch_bucket=batch, context_bucket="unknown",
                      max_k=k, rounds=1, tokens_verified=batch * (k + 1), emitted=batch * 2, batch_rows=batch,
                      latency_p50=s, latency_p95=s, latency_p99=s, draft_s=Stat().add(0.002 * k),
                      verify_s=Stat().add(s), other_s=Stat().add(0.0))


def _store(url: str, batches: list[WindowBatch]) -> None:
    with Store(url, auto_upgrade=True) as store:
        store.ingest(batches)


def _log_windows(n: int, t0: float, k: int = 3, engine: str = "vllm-log:m") -> list[WindowBatch]:
    """Acceptance only, as vLLM's log lines give it (a 4-slot histogram: 0..3 accepted of k = 3)."""
    return [WindowBatch(engine_id=engine, seq=i, window_start=t0 + i, window_end=t0 + i + 1,
                        acceptance=(_acc(k, 400, (80, 80, 120, 120)),), cost=()) for i in range(n)]


def _iteration_windows(n: int, t0: float, k: int = 3) -> list[WindowBatch]:
    """Cost only, as TensorRT-LLM's iteration stats give it at k > 1."""
    return [WindowBatch(engine_id="trtllm:m", seq=i, window_start=t0 + i, window_end=t0 + i + 1, acceptance=(),
                        cost=(_cost(k, (4, 8)[i % 2]),)) for i in range(n)]


# ------------------------------------------------------------------------------------------ missing telemetry
def test_acceptance_only_names_the_missing_cost_and_how_to_supply_it(sqlite_url: str) -> None:
    _store(sqlite_url, _log_windows(20, 1000.0))
    with pytest.raises(TuneError) as e:
        tune(_cfg(sqlite_url))
    msg = str(e.value)
    assert "no cost windows stored" in msg and "m|unknown (acceptance measured at k 3)" in msg
    assert "spectune ingest vllm-prom" in msg and "trtllm" in msg and "--calibration FILE" in msg
    assert "round_s" in msg  # what the calibration file must hold


def test_cost_only_names_the_missing_acceptance_per_k_and_batch_bucket(sqlite_url: str) -> None:
    _store(sqlite_url, _iteration_windows(20, 1000.0))
    with pytest.raises(TuneError) as e:
        tune(_cfg(sqlite_url))
    msg = str(e.value)
    assert "no acceptance windows stored" in msg and "m|unknown: k 3 at batch buckets 4, 8" in msg
    assert "vllm-log" in msg and "sglang" in msg and "TensorRT-LLM iteration stats" in msg


def test_calibration_supplies_cost_and_batch_sizes_without_cost_windows(sqlite_url: str) -> None:
    _store(sqlite_url, _log_windows(20, 1000.0))
    s = tune(_cfg(sqlite_url, calibration=CALIBRATION, profile="small", holdout=0.0))
    assert s["cost"].startswith(f"recorded sweep {CALIBRATION}")
    assert {b["batch_bucket"] for b in s["buckets"]} == {1, 4, 16, 64}  # the sweep's batch sizes
    assert any("replayed at every batch size the sweep measured" in n for n in s["notes"])


def test_log_acceptance_then_iteration_cost_splits_each_kind_by_its_own_time(sqlite_url: str) -> None:
    """vLLM log lines ingested first (acceptance), TensorRT-LLM iteration stats later (cost): the held-out side
    still gets acceptance windows, and tune runs instead of failing with 'no acceptance windows stored'."""
    _store(sqlite_url, _log_windows(30, 1000.0) + _iteration_windows(30, 5000.0))
    with Store(sqlite_url) as store:
        acc, cost = store.acceptance_windows(), store.cost_windows()
    tune_part, held, _ = split_by_time(acc, cost, 0.3)
    assert tune_part.acceptance and held.acceptance and tune_part.cost and held.cost
    s = tune(_cfg(sqlite_url, trials=3))
    assert s["windows"]["tune"] > 0 and s["heldout"]["windows"] == 9


# ------------------------------------------------------------------------------------------ no extrapolation
def test_k_never_goes_past_the_largest_k_drafted_unless_allowed(sqlite_url: str) -> None:
    _store(sqlite_url, _log_windows(30, 1000.0) + _iteration_windows(30, 1000.5))
    s = tune(_cfg(sqlite_url, trials=12, holdout=0.0))
    assert s["k_space"] == {"k_max": 6, "allow_extrapolation": False, "largest_k_measured": 3, "k_limit": 3,
                            "capped": True}
    assert all(b["k_cap"] == 3 and b["tuned_k"] <= 3 for b in s["buckets"])
    table = s["tuned_table"]
    assert table["default_k"] <= 3 and max(table["entries"].values()) <= 3
    assert any(n.startswith("k capped at the largest k drafted") for n in s["notes"])
    free = tune(_cfg(sqlite_url, trials=12, holdout=0.0, allow_extrapolation=True, store=False))
    assert all(b["k_cap"] == 6 for b in free["buckets"]) and free["k_space"]["capped"] is False


def test_k_never_goes_past_the_deepest_k_whose_cost_was_measured_at_that_batch_or_a_larger_one(
        sqlite_url: str) -> None:
    # Acceptance measured up to k = 5; round cost up to k = 5 at batch 1, 2 at batch 8, only k = 0 at batch 32 (a
    # live policy that never drafted there). Deeper ks at batch 8 and 32 would rest on the cost model's guess.
    t0 = 1000.0
    acc = [WindowBatch(engine_id="engine:m", seq=i, window_start=t0 + i, window_end=t0 + i + 1,
                       acceptance=(_acc(5, 400, (40, 40, 60, 60, 80, 120)),), cost=()) for i in range(30)]
    cost = [WindowBatch(engine_id="iterations:m", seq=i, window_start=t0 + i + 0.5, window_end=t0 + i + 1.5,
                        acceptance=(), cost=(_cost(i % 6, 1), _cost(i % 3, 8), _cost(0, 32))) for i in range(30)]
    _store(sqlite_url, acc + cost)
    s = tune(_cfg(sqlite_url, trials=12, holdout=0.0, k_max=5))
    caps = {b["batch_bucket"]: b["k_cap"] for b in s["buckets"]}
    assert caps == {1: 5, 8: 2, 32: 0}
    assert all(b["tuned_k"] <= b["k_cap"] for b in s["buckets"])
    assert any("deepest k whose round cost was measured" in n for n in s["notes"])
    free = tune(_cfg(sqlite_url, trials=12, holdout=0.0, k_max=5, allow_extrapolation=True, store=False))
    assert {b["batch_bucket"]: b["k_cap"] for b in free["buckets"]} == {1: 5, 8: 5, 32: 5}


# ------------------------------------------------------------------------------------------ held-out verdict
def test_no_held_out_verdict_on_too_few_windows(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    store_synthetic(sqlite_url, windows=16)  # about 5 engine windows held out
    path = Path(sqlite_url.removeprefix("sqlite:///")).parent / "s.json"
    assert cli_main(["tune", "--db-url", sqlite_url, "--trials", "4", "--k-max", "6", "--no-progress",
                     "--summary-json", str(path)]) == 0
    s = json.loads(path.read_text())
    assert "heldout_gain" not in s and "beats_seed_on_heldout" not in s
    h = s["heldout"]
    assert 0 < h["windows"] < MIN_HELDOUT_WINDOWS and h["min_windows"] == MIN_HELDOUT_WINDOWS
    assert h["verdict_possible"] is False and h["why_not"].startswith(f"not enough held-out data ({h['windows']} "
                                                                      f"windows, need {MIN_HELDOUT_WINDOWS}")
    out = capsys.readouterr().out
    assert "no held-out verdict: not enough held-out data" in out and "beats the seed" not in out


def test_the_verdict_says_how_much_it_used(sqlite_url: str) -> None:
    store_synthetic(sqlite_url, windows=60)
    s = tune(_cfg(sqlite_url, trials=4))
    assert s["heldout"]["verdict_possible"] and "heldout_gain" in s
    assert s["heldout"]["windows"] >= MIN_HELDOUT_WINDOWS and s["heldout"]["rows"] >= s["heldout"]["min_rows"]


# ------------------------------------------------------------------------------------------ Pareto, names
def test_pareto_front_in_json_and_terminal_and_metric_names(sqlite_url: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import optuna

    store_synthetic(sqlite_url, windows=30)
    path = Path(sqlite_url.removeprefix("sqlite:///")).parent / "s.json"
    study = f"p-{uuid.uuid4().hex[:8]}"
    assert cli_main(["tune", "--db-url", sqlite_url, "--study", study, "--trials", "10", "--k-max", "6",
                     "--holdout", "0", "--latency-objective", "--no-progress", "--summary-json", str(path)]) == 0
    s = json.loads(path.read_text())
    loaded = optuna.load_study(study_name=study, storage=sqlite_url)
    front = {t.number for t in loaded.best_trials}
    assert {p["trial"] for p in s["pareto_front"]} == front and len(front) >= 1
    assert sum(p["chosen"] for p in s["pareto_front"]) == 1
    tok = [p["goodput_tok_s"] for p in s["pareto_front"]]
    assert tok == sorted(tok, reverse=True)
    out = capsys.readouterr().out
    assert "Pareto front" in out and all(str(p["trial"]) in out for p in s["pareto_front"])
    assert loaded.metric_names == ["goodput_tok_s", "tpot_p99_s"]
    single = TuneConfig(db_url=sqlite_url, study=f"q-{uuid.uuid4().hex[:8]}", trials=2, k_max=6, holdout=0.0,
                        progress=False, store=False)
    tune(single)
    assert optuna.load_study(study_name=single.study, storage=sqlite_url).metric_names == ["goodput_tok_s"]


# ------------------------------------------------------------------------------------------ stored table
def test_the_tuned_table_is_stored_and_export_finds_it(sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _store(sqlite_url, _log_windows(30, 1000.0) + _iteration_windows(30, 1000.5))
    cfg = _cfg(sqlite_url, trials=5, holdout=0.0)
    s = tune(cfg)
    assert s["stored"] == {"db_url": sqlite_url, "version": 1, "new": True}
    with Store(sqlite_url) as store:
        latest = store.latest_policy_version()
    assert latest is not None and latest.reason == f"tuned by spectune tune study={cfg.study} trial={s['best_trial']}"
    assert s["tuned_table"]["entries"] == latest.entries
    assert tune(cfg)["stored"]["new"] is False  # the same table is not stored twice
    capsys.readouterr()
    assert cli_main(["export", "vllm", "--db-url", sqlite_url, "--table-only"]) == 0
    assert "table v1" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ one prediction
def _export_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[float, float, float]:
    capsys.readouterr()
    assert cli_main(["export", *argv, "--table-only"]) == 0
    err = capsys.readouterr().err
    m = re.search(r"full table ([\d.]+) tok/s, exported ([\d.]+) tok/s \((-?[\d.]+)% lost", err)
    assert m, err
    return float(m[1]), float(m[2]), float(m[3])


@pytest.mark.parametrize("calibrated", [False, True])
def test_tune_and_export_predict_the_same_and_export_never_gains(sqlite_url: str, calibrated: bool,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    store_synthetic(sqlite_url, windows=30)
    cal = {"calibration": CALIBRATION, "profile": "small"} if calibrated else {}
    s = tune(_cfg(sqlite_url, trials=6, **cal))
    whole = s["predicted_all_windows"]
    extra = ["--calibration", str(CALIBRATION), "--profile", "small"] if calibrated else []
    assert whole["export"].endswith(" ".join(extra))
    for engine in ("vllm", "trtllm"):
        full, exported, lost = _export_line(capsys, [engine, "--db-url", sqlite_url, *extra])
        assert full == pytest.approx(whole["tuned_tok_s"], rel=1e-6, abs=1e-3)
        assert lost >= 0.0
        assert exported <= full * (1 + 1e-9) or lost == 0.0


def test_projection_loss_is_never_negative() -> None:
    assert pj.projection_loss(100.0, 90.0) == (pytest.approx(0.1), None)
    loss, note = pj.projection_loss(100.0, 120.0)
    assert loss == 0.0 and note is not None and "20.0% more than the full table" in note
    assert pj.projection_loss(0.0, 5.0) == (0.0, None)


# ------------------------------------------------------------------------------------------ signals
def _count(db: Path, state: str) -> int:
    try:
        with sqlite3.connect(db, timeout=10) as con:
            return int(con.execute("SELECT count(*) FROM trials WHERE state = ?", (state,)).fetchone()[0])
    except sqlite3.OperationalError:  # the study's tables are not created yet
        return 0


def _wait(cond: object, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return
        time.sleep(POLL_S)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("presses", [1, 2])
def test_sigint_leaves_no_trial_running_and_exits_130(sqlite_url: str, tmp_path: Path, presses: int) -> None:
    store_synthetic(sqlite_url, windows=30)
    db = Path(sqlite_url.removeprefix("sqlite:///"))
    summary = tmp_path / "s.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "controller.cli", "tune", "--db-url", sqlite_url, "--trials",
                             "100000", "--k-max", "6", "--holdout", "0", "--no-progress", "--timeout", "120",
                             "--summary-json", str(summary)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: _count(db, "COMPLETE") >= 3, "three finished trials")
        for _ in range(presses):
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "UnboundLocalError" not in err and "Traceback" not in err
    assert _count(db, "RUNNING") == 0
    s = json.loads(summary.read_text())
    assert s["interrupted"] is True and s["signal"] == signal.SIGINT and s["stored"] is None
    assert "interrupted" in out and "k per bucket" in out  # what the finished trials give
    with Store(sqlite_url) as store:
        assert store.latest_policy_version().version == 1  # type: ignore[union-attr]  # the seed, nothing stored
