"""``spectune report --by k|position|cost`` on a real SQLite store filled with hand-built windows; every figure
below is worked out by hand from the windows."""

from __future__ import annotations

import pytest

from controller.cli import main as spectune
from controller.report import by_cost, by_k, by_position
from telemetry.records import AcceptanceWindow, CostWindow, Stat, WindowBatch
from telemetry.store import Store

T, D = "t1", "d1"


def acc(rt: str, ctx: str, k: int, hist: tuple[int, ...]) -> AcceptanceWindow:
    rows = sum(hist)
    accepted = sum(i * n for i, n in enumerate(hist))
    return AcceptanceWindow(T, D, rt, ctx, k, rows, rows * k, accepted, accepted + rows, hist)


def cost(batch: int, ctx: str, max_k: int, rounds: int, verified: int, emitted: int, seconds: tuple[float, ...]
         ) -> CostWindow:
    draft, verify, other = (Stat(rounds, s, s * s / rounds, s / rounds) for s in seconds)
    return CostWindow(T, D, batch, ctx, max_k, rounds, verified, emitted, rounds * batch, draft, verify, other,
                      0.01, 0.02, 0.03)


ACCEPTANCE = (
    acc("code", "<=512", 3, (2, 3, 1, 4)),  # 10 rows, accepted 0*2 + 1*3 + 2*1 + 3*4 = 17, emitted 27
    acc("code", "<=2048", 3, (4, 2, 2, 2)),  # 10 rows, accepted 2 + 4 + 6 = 12, emitted 22
    acc("code", "<=512", 1, (3, 5)),  # 8 rows, accepted 5, emitted 13
    acc("prose", "<=512", 0, (5,)),  # 5 rows without drafting: emitted 5
)
COST = (
    cost(8, "<=512", 3, rounds=10, verified=320, emitted=200, seconds=(0.1, 0.3, 0.1)),  # 0.5 s
    cost(8, "<=2048", 2, rounds=30, verified=720, emitted=400, seconds=(0.2, 0.6, 0.2)),  # 1.0 s
    cost(1, "<=512", 4, rounds=20, verified=100, emitted=60, seconds=(0.04, 0.1, 0.06)),  # 0.2 s
)


def test_by_k_pools_counts_per_k() -> None:
    _, cols, rows = by_k(ACCEPTANCE)
    assert cols[-3:] == ["rows", "acceptance rate", "mean acceptance length"]
    assert rows == [
        [T, D, "code", "1", "8", "0.625", "1.625"],  # 5 / 8 accepted; 13 / 8 emitted per row
        [T, D, "code", "3", "20", "0.483", "2.450"],  # (17 + 12) / 60 = 0.4833; (27 + 22) / 20 = 2.45
        [T, D, "prose", "0", "5", "-", "1.000"],  # nothing drafted; the bonus token alone
    ]


def test_by_position_is_the_pooled_acceptance_curve() -> None:
    _, _, rows = by_position(ACCEPTANCE)
    # k = 3 pooled hist (6, 5, 3, 6) over 20 rows: P(>=1) = 14/20, P(>=2) = 9/20, P(>=3) = 6/20
    assert rows == [
        [T, D, "code", "1", "8", "0.625", "0"],  # P(>=1) = 5/8
        [T, D, "code", "3", "20", "0.700 0.450 0.300", "0"],
    ]  # k = 0 has no positions


def test_by_position_counts_rows_whose_histogram_does_not_cover_them() -> None:
    broken = AcceptanceWindow(T, D, "code", "<=512", 2, 10, 20, 6, 16, (1, 1, 1))  # 3 of 10 rows in the hist
    _, _, rows = by_position([broken])
    assert rows == [[T, D, "code", "2", "0", "-", "10"]]


def test_by_cost_per_batch_bucket() -> None:
    _, cols, rows = by_cost(COST)
    assert cols[2:] == ["batch bucket", "largest k", "rounds", "mean batch", "mean round ms",
                        "tokens verified / round", "goodput tok/s"]
    assert rows == [
        [T, D, "1", "4", "20", "1.0", "10.00", "5.0", "300.0"],  # 200 ms / 20 rounds; 100 / 20; 60 / 0.2 s
        [T, D, "8", "2 3", "40", "8.0", "37.50", "26.0", "400.0"],  # 1500 ms / 40; 1040 / 40; 600 / 1.5 s
    ]


@pytest.mark.parametrize(("view", "expect"), [
    ("k", ["2.450", "1.625", "0.483"]),
    ("position", ["0.700 0.450 0.300"]),
    ("cost", ["37.50", "400.0", "26.0"]),
])
def test_cli_report_by(sqlite_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                       view: str, expect: list[str]) -> None:
    monkeypatch.setenv("COLUMNS", "240")  # rich wraps at the terminal width
    with Store(sqlite_url, auto_upgrade=True) as store:
        store.ingest([WindowBatch("e", 1, 0.0, 1.0, acceptance=ACCEPTANCE, cost=COST)])
    assert spectune(["report", "--db-url", sqlite_url, "--by", view]) == 0
    out = capsys.readouterr().out
    assert all(figure in out for figure in expect), out
    assert spectune(["report", "--db-url", sqlite_url]) == 0  # the default view stays the summary
    assert "newest policy versions" in capsys.readouterr().out
