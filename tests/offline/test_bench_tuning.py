"""``bench tuning``'s generated engine records stay in the shapes the parsers read, and its explorer's draws."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench.tuning import GENERATORS, K_MAX, SOURCES_BENCHED, Explorer
from controller.offline.ingest import IngestConfig, Ingestor, ingest_paths


@pytest.mark.parametrize("source", SOURCES_BENCHED)
def test_every_generated_record_parses_into_windows(source: str, tmp_path: Path) -> None:
    path = tmp_path / f"{source}.txt"
    path.write_text(GENERATORS[source](40, 7))
    ing = Ingestor(IngestConfig(source=source, model="bench-model"), None)  # parse only (--dry-run)
    ingest_paths(ing, [str(path)])
    s = ing.summary
    assert s.records == 40 and not s.malformed, (s.malformed, [r.detail for r in ing.rejects[:3]])
    # every record yields a window (TensorRT-LLM's totals give no per-position histogram: cost windows only)
    assert s.acceptance_windows + s.cost_windows >= 40 - (source == "vllm-prom")  # the first scrape is a baseline


def test_generators_are_seeded() -> None:
    for gen in GENERATORS.values():
        assert gen(5, 1) == gen(5, 1) and gen(5, 1) != gen(5, 2)


def test_explorer_spreads_the_largest_k_over_every_value(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr("bench.tuning.time.monotonic", lambda: now[0])
    ex = Explorer(seed=3, k_max=K_MAX, every_s=0.5)
    largest: Counter[int] = Counter()
    for period in range(900):
        now[0] = period * 0.5
        ks = [ex.decide(rt, 8, ctx) for rt in ("code", "prose", "structured") for ctx in (100, 1500)]
        assert all(0 <= k <= K_MAX for k in ks)
        assert ks == [ex.decide(rt, 8, ctx) for rt in ("code", "prose", "structured") for ctx in (100, 1500)]
        largest[max(ks)] += 1
    assert set(largest) == set(range(K_MAX + 1))
    assert min(largest.values()) >= 900 / (K_MAX + 1) / 4  # no largest k starved (independent draws: 0-2 rare)


def test_engine_check_compares_each_busy_bucket_with_the_sweeps_best(tmp_path: Path) -> None:
    from bench.tuning import engine_check

    cells = [{"profile": "xl", "request_type": "code", "batch_size": 1, "context_len": 300, "plain_tok_s": 80.0,
              "spec_tok_s": {"1": 100.0, "5": 185.0}},
             {"profile": "xl", "request_type": "prose", "batch_size": 64, "context_len": 200, "plain_tok_s": 1100.0,
              "spec_tok_s": {"1": 1000.0}},
             {"profile": "small", "request_type": "code", "batch_size": 1, "context_len": 300, "plain_tok_s": 1.0,
              "spec_tok_s": {"1": 900.0}}]
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"device": "cpu", "cells": cells}))
    buckets = [{"request_type": "code", "batch_bucket": 1, "context_bucket": "<=512", "share": 0.10, "tuned_k": 0},
               {"request_type": "prose", "batch_bucket": 64, "context_bucket": "<=512", "share": 0.08, "tuned_k": 1},
               {"request_type": "prose", "batch_bucket": 8, "context_bucket": "<=512", "share": 0.05, "tuned_k": 2},
               {"request_type": "code", "batch_bucket": 4, "context_bucket": "<=512", "share": 0.01, "tuned_k": 0}]
    out = engine_check(buckets, path, "xl")
    by = {(r["request_type"], r["batch_bucket"]): r for r in out["buckets"]}
    assert set(by) == {("code", 1), ("prose", 64), ("prose", 8)}  # the 1% bucket is not checked
    assert by[("code", 1)]["best_k"] == 5 and by[("code", 1)]["ratio"] == pytest.approx(80.0 / 185.0)
    assert by[("prose", 64)]["ratio"] == pytest.approx(1000.0 / 1100.0)
    assert "ratio" not in by[("prose", 8)]  # no batch-8 cell in the sweep
    assert (out["checked"], out["unmeasured"], out["below_threshold"]) == (2, 1, 2)
    assert out["min_ratio"] == pytest.approx(80.0 / 185.0)


def test_engine_check_takes_the_nearest_context_when_none_lies_in_the_bucket(tmp_path: Path) -> None:
    # The sweep's batch-1 short-prompt cell decodes past 512 tokens: it is still the <=512 bucket's measurement,
    # and the long-prompt cell stays the <=2048 bucket's.
    from bench.tuning import engine_check

    cells = [{"profile": "xl", "request_type": "code", "batch_size": 1, "context_len": 579, "plain_tok_s": 80.0,
              "spec_tok_s": {"5": 140.0}},
             {"profile": "xl", "request_type": "code", "batch_size": 1, "context_len": 1299, "plain_tok_s": 70.0,
              "spec_tok_s": {"5": 100.0, "6": 125.0}}]
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"device": "cpu", "cells": cells}))
    buckets = [{"request_type": "code", "batch_bucket": 1, "context_bucket": cb, "share": 0.1, "tuned_k": 5}
               for cb in ("<=512", "<=2048")]
    out = engine_check(buckets, path, "xl")
    short, long = out["buckets"]
    assert (short["measured_context"], short["best_k"], short["ratio"]) == (579, 5, 1.0)
    assert (long["measured_context"], long["best_k"]) == (1299, 6)
    assert long["ratio"] == pytest.approx(100.0 / 125.0)
