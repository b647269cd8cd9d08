"""``bench tuning``'s generated engine records stay in the shapes the parsers read, and its explorer's draws."""

from __future__ import annotations

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
