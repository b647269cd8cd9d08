"""The demo in quick mode: the real engine, the sidecar learning live, the report folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.reference import demo
from controller.reference.demo_log import RoundLog, RunLog
from telemetry.records import DEFAULT_BUCKETS


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
