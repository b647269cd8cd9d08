"""``spectune ingest`` end to end: fixtures into a real store (SQLite and PostgreSQL), rejects kept, follow mode."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from scrape_server import Scrapes

from controller.cli import main as spectune
from controller.offline.ingest import IngestConfig, Ingestor, follow, ingest_paths
from controller.offline.sources import vllm_prom
from telemetry.store import Store

FIXTURES = Path(__file__).resolve().parent / "fixtures"

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def test_every_source_into_the_store_once(db_url: str) -> None:
    with Store(db_url, auto_upgrade=True) as store:
        runs = [
            ("vllm-prom", "vllm_metrics.prom", None), ("vllm-log", "vllm_spec.log", MODEL),
            ("vllm-request", "vllm_requests.jsonl", None), ("sglang", "sglang_meta.jsonl", "Qwen/Qwen3-8B"),
            ("trtllm", "trtllm_iterations.jsonl", "llama-70b"),
        ]
        stored = {}
        for source, name, model in runs:
            ing = Ingestor(IngestConfig(source=source, model=model), store)
            ingest_paths(ing, [str(FIXTURES / name)])
            stored[source] = ing.summary
            again = Ingestor(IngestConfig(source=source, model=model), store)
            ingest_paths(again, [str(FIXTURES / name)])
            assert again.summary.batches_new == 0  # the same records, ingested twice, are stored once
            assert again.summary.batches_duplicate == ing.summary.batches_new
        acc = store.acceptance_windows()
        cost = store.cost_windows()
    s = stored["vllm-prom"]
    assert (s.acceptance_windows, s.partial["mixed_draft_lengths"], s.notes["counter_reset"]) == (3, 1, 1)
    assert stored["vllm-log"].malformed == {"bad_log_line": 1, "mean_contradicts_counts": 1}
    assert stored["vllm-request"].malformed == {"bad_json": 1, "inconsistent_counts": 1}
    assert stored["vllm-request"].acceptance_windows == 3
    assert stored["sglang"].malformed == {"inconsistent_counts": 1, "bad_json": 1}
    assert stored["trtllm"].skipped == {"no_spec_stats": 1, "histogram_unknown": 2, "mixed_draft_lengths": 1}
    assert stored["trtllm"].cost_windows == 3 and stored["trtllm"].acceptance_windows == 1
    targets = {w.window.target_version for w in acc}
    assert targets == {MODEL, "Qwen/Qwen3-8B", "llama-70b"}  # each engine's model name is the target version
    assert {w.window.request_type for w in acc} == {"unknown"}
    assert {w.window.target_version for w in cost} == {"llama-70b", MODEL}  # vLLM: latency histogram
    assert sum(1 for w in acc if w.window.target_version == MODEL) == 3 + 2 + 3  # prom (one partly), log, request


def test_cli_ingest_keeps_rejects_with_line_numbers(tmp_path: Path, sqlite_url: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rejects, summary = tmp_path / "rejects.jsonl", tmp_path / "summary.json"
    rc = spectune(["ingest", "vllm-request", str(FIXTURES / "vllm_requests.jsonl"), "--db-url", sqlite_url,
                   "--auto-upgrade", "--version", "v1", "--rejects", str(rejects), "--summary-json", str(summary)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "3 acceptance and 0 cost windows" in out and "rejected (malformed): bad_json 1" in out
    kept = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [(r["line"], r["kind"], r["reason"]) for r in kept] == [
        (3, "skipped", "mixed_draft_lengths"), (4, "malformed", "bad_json"), (5, "malformed", "inconsistent_counts")]
    assert kept[1]["raw"].startswith('{"id": "chatcmpl-4"')  # the bad line itself, for the operator
    assert json.loads(summary.read_text())["acceptance_windows"] == 3
    with Store(sqlite_url) as store:
        assert {w.window.target_version for w in store.acceptance_windows()} == {"v1"}  # --version wins


def test_cli_ingest_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = spectune(["ingest", "vllm-log", str(FIXTURES / "vllm_spec.log"), "--dry-run",
                   "--rejects", str(tmp_path / "r.jsonl")])
    assert rc == 2  # no model name: refused up front, with what to pass
    assert "--model" in capsys.readouterr().err
    assert spectune(["ingest", "vllm-log", "--follow", "http://127.0.0.1:1/metrics"]) == 2
    assert "vllm-prom" in capsys.readouterr().err


@pytest.fixture
def metrics_server(scrape_url: str) -> str:
    """The recorded scrapes of ``vllm_metrics.prom``, one per request, then 404."""
    Scrapes.bodies = [text for _, _, text in vllm_prom.split_scrapes((FIXTURES / "vllm_metrics.prom").read_text())]
    return scrape_url


def test_follow_polls_recorded_scrapes(metrics_server: str, sqlite_url: str) -> None:
    with Store(sqlite_url, auto_upgrade=True) as store:
        ing = Ingestor(IngestConfig(source="vllm-prom"), store)
        n = follow(ing, metrics_server, interval_s=0.01, stop=threading.Event(), max_scrapes=5, timeout_s=2)
        windows = store.acceptance_windows()
    assert n == 5
    s = ing.summary
    assert (s.acceptance_windows, s.batches_new) == (3, 3)  # scrape 2, the mixed one's position 1, scrape 4
    assert s.partial["mixed_draft_lengths"] == 1 and s.malformed["scrape_failed"] == 1  # the 404 is kept
    assert [w.window.hist for w in windows] == [(40, 40, 50, 70), (40, 60), (20, 10, 10, 10)]
    assert ing.rejects[-1].reason == "scrape_failed" and "404" in ing.rejects[-1].detail


def test_cli_follow(metrics_server: str, sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = spectune(["ingest", "vllm-prom", "--follow", metrics_server, "--interval", "0.01", "--scrapes", "2",
                   "--db-url", sqlite_url, "--auto-upgrade", "--rejects", str(tmp_path / "r.jsonl")])
    assert rc == 0
    assert "1 acceptance and 1 cost windows, 1 new window batches stored" in capsys.readouterr().out
