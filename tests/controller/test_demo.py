"""The demo in quick mode: the real engine, the sidecar learning live, the report folder."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest

from controller.reference import demo
from controller.reference.demo_log import RoundLog, RunLog
from controller.reference.workload import POOL_SIZE, WORKLOADS, Phase, PromptPool, RequestStream
from telemetry.alerts import ACCEPTANCE_DRIFT
from telemetry.records import DEFAULT_BUCKETS, RoundRecord


@pytest.mark.slow
def test_quick_demo_writes_its_report(tmp_path: Path, checkpoints: Path, prompt_cache: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    # The small profile: tests load the trained pair as shipped (xl's cost is the benchmarks' business).
    rc = demo.main(["--quick", "--profile", "small", "--checkpoints", str(checkpoints), "--out", str(tmp_path),
                    "--device", "cpu", "--prompt-cache", str(prompt_cache)])
    assert rc == 0
    out = capsys.readouterr().out
    (run,) = tmp_path.glob("demo-*")
    assert f"report: {run / 'summary.md'}" in out
    for f in ("summary.md", "throughput.png", "acceptance.png", "chosen_k.png", "spectune.sqlite"):
        assert (run / f).stat().st_size > 0, f
    summary = (run / "summary.md").read_text()
    for heading in ("## Tokens per second", "## Acceptance per request type", "## k chosen per bucket",
                    "## Speculation turned off / on", "## Policy versions"):
        assert heading in summary
    assert "| overall |" in summary and "- v1 at t=" in summary
    result = json.loads((run / "demo.json").read_text())
    assert set(result["ratios"]) == {"learned_over_static", "learned_over_best_static", "learned_over_best_per_bucket"}
    assert result["best_static_k"] in (3, 2, 4, 6)
    best = result["tokens"][f"static k={result['best_static_k']}"]
    assert result["ratios"]["learned_over_best_static"] == pytest.approx(result["tokens"]["learned"] / best)
    assert all(best >= v for name, v in result["tokens"].items() if name.startswith("static"))
    # Static k is played just before and just after the learned run; its figure is the mean of the two.
    bracket = result["static_bracket"]
    assert bracket["k"] == 3 and bracket["before_tok_s"] > 0 and bracket["after_tok_s"] > 0
    assert result["tok_s"]["static k=3"] == pytest.approx((bracket["before_tok_s"] + bracket["after_tok_s"]) / 2)
    assert result["ratios"]["learned_over_static"] == pytest.approx(
        result["tokens"]["learned"] / result["tokens"]["static k=3"])
    assert "static k=3 (before)" in summary
    assert "learned / best static in hindsight" in out


def test_best_per_cell_reads_rounds_by_name() -> None:
    # Two ks in one cell: k=4 emits more per second than k=2; a third k has too few rounds to be picked.
    def rnd(k: int, emitted: int, phase: int = 0) -> RoundLog:
        return RoundLog(t=0.0, phase=phase, target_version="target-v1", batch_size=4, max_context=100, max_k=k,
                        emitted=emitted, wall_s=0.1)

    log = RunLog("x", rounds=[*(rnd(2, 10) for _ in range(3)), *(rnd(4, 20, phase=1) for _ in range(3)),
                              *(rnd(6, 90) for _ in range(demo.MIN_ROUNDS_FOR_BEST - 1))])
    cell = demo.cell_of(log.rounds[0])
    assert cell == ("target-v1", DEFAULT_BUCKETS.batch_bucket(4), DEFAULT_BUCKETS.context_bucket(100))
    assert demo.best_per_cell([log]) == {cell: (4, pytest.approx(200.0))}
    few = 90 * (demo.MIN_ROUNDS_FOR_BEST - 1)
    assert (log.tokens(), log.tokens(0), log.tokens(1)) == (30 + 60 + few, 30 + few, 60)


def test_structured_prompts_of_the_second_schema_differ(prompt_cache: Path) -> None:
    pool = PromptPool(0, prompt_cache)
    one = {pool.get("structured", False, i) for i in range(8)}
    two = {pool.get("structured", False, i, schema=2) for i in range(8)}
    assert one and two and not one & two
    assert pool.get("code", False, 3, schema=2) == pool.get("code", False, 3)  # only structured prompts change
    stream = RequestStream(pool, seed=1)
    drifted = Phase("drift", 1.0, load=1, mix=(0.0, 0.0, 1.0), structured_schema=2)
    assert stream.next(drifted).prompt in {pool.get("structured", False, i, schema=2) for i in range(POOL_SIZE)}
    with pytest.raises(ValueError, match="structured_schema"):
        Phase("bad", 1.0, load=1, structured_schema=3)


def test_demo_workload_drifts_silently_before_the_model_update() -> None:
    phases = WORKLOADS["demo"]
    drift = next(i for i, p in enumerate(phases) if p.structured_schema == 2)
    update = next(i for i, p in enumerate(phases) if p.update)
    assert drift < update and not phases[drift].update
    assert phases[drift - 1].load == phases[drift].load and phases[drift - 1].mix == phases[drift].mix
    assert all(p.structured_schema == 2 for p in phases[drift:])  # a silent change stays


SILENT_DRIFT_ROWS = 600  # structured rows after the switch: old requests finish first, then ADWIN needs ~300
# Each phase lasts its seconds and its rounds, whichever ends later. The detector counts rows (load 4, 80%
# structured: ~3.2 structured rows a round); its confirmation counts windows, one every 0.25 s whatever the load.
# A quiet 2-core machine decodes more than these rounds in these seconds (490 / 1,200 structured rows).
STEADY_S, STEADY_ROUNDS = 20.0, 150
DRIFT_S, DRIFT_ROUNDS = 15.0, 300


class PhaseClock:
    """The workload's time module in the drift test; everything but ``monotonic`` is the real one.

    ``monotonic()`` reports a phase as over (the sum of the phase lengths so far) only once it has lasted both
    its wall seconds and its engine rounds (counted in ``rounds`` by the caller): a machine busy with other work,
    a parallel test run for one, then decodes as many rows per phase as a quiet one, only later.

    Args:
        phases: (seconds, rounds) of each phase, in the order the workload runs them.
    """

    def __init__(self, phases: list[tuple[float, int]]) -> None:
        self.phases = phases
        self.index = 0  # the phase under way
        self.done_s = 0.0  # the lengths of the phases over
        self.rounds = 0  # rounds decoded in the phase under way
        self.started: float | None = None  # real monotonic time the phase under way started
        self.ended_at: list[float] = []  # wall time (time.time) each phase ended

    def monotonic(self) -> float:
        now = time.monotonic()
        if self.index == len(self.phases):
            return self.done_s
        if self.started is None:
            self.started = now
        seconds, rounds = self.phases[self.index]
        elapsed = now - self.started
        if elapsed >= seconds and self.rounds >= rounds:
            self.done_s += seconds
            self.index, self.rounds, self.started = self.index + 1, 0, now
            self.ended_at.append(time.time())
            return self.done_s
        return self.done_s + min(elapsed, seconds * self.rounds / rounds)  # below the phase's end until both hold

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


@pytest.mark.slow
def test_silent_drift_raises_an_acceptance_drift_naming_structured(
        tmp_path: Path, checkpoints: Path, prompt_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The demo's structured stretch and silent drift through the demo's sidecar (engine hooks -> transport ->
    # sidecar -> alerts), longer than --quick makes them (0.9 s each is too few rows to tell a drift from noise),
    # with k fixed at 3 (a baseline run with alerts on), so how soon it fires does not depend on where a learning
    # policy moves k; either monitor may raise it (k=3's, or the first-draft one across k).
    import controller.reference.workload as workload
    from engine.loop import SpecEngine

    cfg = demo.DemoConfig(out_root=tmp_path, checkpoints=checkpoints, profile="small", device="cpu",
                          prompt_cache=prompt_cache, max_batch=8)
    steady, drift = (p for p in WORKLOADS["demo"] if p.name in ("structured", "silent drift"))
    phases = (replace(steady, seconds=STEADY_S), replace(drift, seconds=DRIFT_S))
    eng = demo._Engine(cfg)  # its warm-up decodes before the clock below counts rounds
    clock = PhaseClock([(STEADY_S, STEADY_ROUNDS), (DRIFT_S, DRIFT_ROUNDS)])
    step = SpecEngine.step

    def counted_step(self: SpecEngine, policy: Callable[[str, int, int], int]) -> RoundRecord | None:
        r = step(self, policy)
        if r is not None:
            clock.rounds += 1
        return r

    monkeypatch.setattr(workload, "time", clock)
    monkeypatch.setattr(SpecEngine, "step", counted_step)
    log, sidecar = demo._live_run(cfg, eng, phases, tmp_path, "fixed k", lambda *_: None,
                                  partial(demo._constant, 3), alerts_on=True)
    drifts = [a for a in sidecar.recent_alerts if a.kind == ACCEPTANCE_DRIFT and a.bucket.split("|")[2] == "structured"]
    rows = [sum(r.request_type == "structured" for r in log.rows if r.phase == i) for i in (0, 1)]
    assert rows[0] >= 2 * demo.DEMO_MIN_BEFORE and rows[1] >= SILENT_DRIFT_ROWS, rows
    assert any(a.direction == "down" and a.k in (3, None) for a in drifts), (
        [a.message for a in sidecar.recent_alerts], dict(sidecar.alerts.stats) if sidecar.alerts else None)
    # no alarm in the steady phase: every drift is stamped with a window that ended after the switch
    assert len(clock.ended_at) == 2 and all(a.detected_at >= clock.ended_at[0] for a in drifts)


def test_static_k_is_the_mean_of_the_runs_around_the_learned_one() -> None:
    # The machine speeds up from run to run: static k=3 makes 100 tokens before the learned run and 200 after it.
    def log(name: str, tokens: int) -> RunLog:
        rounds = [RoundLog(t=0.0, phase=0, target_version="target-v1", batch_size=4, max_context=100, max_k=3,
                           emitted=tokens, wall_s=0.1)]
        return RunLog(name, rounds=rounds, wall_s=1.0)

    cfg = demo.DemoConfig(sweep_ks=(2,))
    statics = {3: log("static k=3", 200), 2: log("static k=2", 160)}
    r = demo.demo_result(cfg, "cpu", log("learned", 150), statics, log("hindsight", 300), log("before", 100))
    assert r["tokens"]["static k=3"] == 150 and r["ratios"]["learned_over_static"] == pytest.approx(1.0)
    assert r["best_static_k"] == 2  # 160 beats the bracketed 150, though the later k=3 run alone made 200
    assert r["static_bracket"] == {"k": 3, "before_tok_s": 100.0, "after_tok_s": 200.0}
    assert "static_bracket" not in demo.demo_result(cfg, "cpu", log("learned", 150), statics, log("h", 300))
