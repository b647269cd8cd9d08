"""Every registered policy: bounds, determinism under a seed, snapshot/restore, unknown buckets, garbage input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from controller.offline.simulator import Calibration, buckets_of, simulate, workload
from policies import REGISTRY, DecisionKind, Policy
from telemetry.records import AcceptanceWindow, Bucket, CostWindow, RecordError, Stat

FIXTURE = Path(__file__).with_name("fixture_engine.json")
NAMES = sorted(REGISTRY)


@pytest.fixture(scope="module")
def cal() -> Calibration:
    return Calibration(FIXTURE)


def _trained(name: str, cal: Calibration, seed: int = 0, k_max: int = 6) -> tuple[Policy, list[Bucket]]:
    p = REGISTRY[name](k_max=k_max, seed=seed)
    specs = workload(cal.types, 1500, seed=3)
    simulate(p, cal, specs, seed=5)
    buckets = sorted({b for s in specs for b in buckets_of(cal, s)}, key=lambda b: b.key())
    return p, buckets


def _acc(**kw: object) -> AcceptanceWindow:
    base = dict(target_version="target-v1", draft_version="draft-v1", request_type="code", context_bucket="<=512",
                k=2, rows=3, drafted=6, accepted=4, emitted=7, hist=(1, 0, 2))
    base.update(kw)
    return AcceptanceWindow(**base)  # type: ignore[arg-type]


def _cost(**kw: object) -> CostWindow:
    st = Stat(2, 0.02, 0.0002, 0.011)
    base = dict(target_version="target-v1", draft_version="draft-v1", batch_bucket=4, context_bucket="<=512",
                max_k=2, rounds=2, tokens_verified=24, emitted=12, batch_rows=8, draft_s=st, verify_s=st,
                other_s=st, latency_p50=0.01, latency_p95=0.02, latency_p99=0.03)
    base.update(kw)
    return CostWindow(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
def test_k_within_bounds(name: str, cal: Calibration) -> None:
    p, buckets = _trained(name, cal, k_max=3)
    for b in buckets:
        for explore in (True, False):
            d = p.decide(b, explore=explore)
            assert 0 <= d.k <= 3
            assert isinstance(d.kind, DecisionKind) and isinstance(d.reason, str)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_under_seed(name: str, cal: Calibration) -> None:
    a, buckets = _trained(name, cal, seed=7)
    b, _ = _trained(name, cal, seed=7)
    assert [a.decide(x).k for x in buckets] == [b.decide(x).k for x in buckets]
    assert a.snapshot() == b.snapshot()


@pytest.mark.parametrize("name", NAMES)
def test_snapshot_restore_round_trip(name: str, cal: Calibration) -> None:
    p, buckets = _trained(name, cal)
    snap = json.loads(json.dumps(p.snapshot(), allow_nan=False))  # plain JSON-safe data
    q = REGISTRY[name](k_max=p.k_max, seed=999)
    q.restore(snap)
    assert [p.decide(b).k for b in buckets] == [q.decide(b).k for b in buckets]
    table = q.table(buckets, version=3)
    assert table.version == 3 and all(0 <= k <= q.k_max for k in table.entries.values())
    with pytest.raises(RecordError):
        q.restore({**snap, "snapshot_version": 99})
    with pytest.raises(RecordError):
        q.restore({**snap, "policy": "someone-else"})


@pytest.mark.parametrize("name", NAMES)
def test_unknown_buckets(name: str, cal: Calibration) -> None:
    p, _ = _trained(name, cal)
    fresh = REGISTRY[name](k_max=4, seed=0)
    for b in (Bucket("target-v9", "draft-v3", "poetry", 256, ">8192"), Bucket("target-v1", "draft-v1", "code", 2,
                                                                              "weird-ctx")):
        for pol in (p, fresh):
            assert 0 <= pol.decide(b).k <= pol.k_max


@pytest.mark.parametrize("name", NAMES)
def test_garbage_windows_rejected(name: str) -> None:
    p = REGISTRY[name](k_max=4, seed=0)
    p.observe(_acc())
    p.observe(_cost())
    bad = [
        _acc(hist=(1, 0)),  # wrong number of bins
        _acc(accepted=7),  # accepted > drafted
        _acc(rows=-1),
        _acc(request_type=""),
        _cost(tokens_verified=7),
        _cost(draft_s=Stat(2, float("nan"), 0.0, 0.0)),
        _cost(rounds=0, batch_rows=0, tokens_verified=0),
        {"k": 2},
        None,
    ]
    for w in bad:
        with pytest.raises(RecordError):
            p.observe(w)  # type: ignore[arg-type]
    with pytest.raises(RecordError):
        p.decide("code|4")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
def test_implausible_windows_are_refused_and_learning_goes_on(name: str, cal: Calibration) -> None:
    """Windows no engine produces (the wire's tallies and seconds per round are bounded): refused, and the
    policy's state stays finite. The fault suite's fuzzer found these: a forged cost window of ~1e308 seconds,
    then allowed, overflowed goodput's cost aggregates to inf, and every later observe() failed."""
    p, buckets = _trained(name, cal)
    huge = Stat(2, 1e308, 1e308, 1e308)
    big = 1 << 62
    for w in (_cost(verify_s=huge), _cost(draft_s=huge, verify_s=huge, other_s=huge),
              _cost(rounds=big // 8, batch_rows=big // 4, tokens_verified=big // 2, emitted=big // 2),
              _acc(rows=big // 2, drafted=big, accepted=4, emitted=big // 2 + 4, hist=(big // 2 - 2, 0, 2))):
        with pytest.raises(RecordError) as e:
            p.observe(w)
        assert e.value.reason in ("implausible", "out_of_range")
    p.observe(_cost())  # still learning from real windows
    p.observe(_acc())
    assert all(0 <= p.decide(b).k <= p.k_max for b in buckets)
    json.dumps(p.snapshot(), allow_nan=False)  # nothing non-finite got in


def test_registry_names_match() -> None:
    assert set(REGISTRY) == {"static", "batch_table", "trtllm_schedule", "hf_heuristic", "sglang_adaptive",
                             "sglang_adaptive_bs", "vllm_dynamic", "ucb", "goodput"}
    for name, cls in REGISTRY.items():
        assert cls.name == name


def test_dataclass_decision_is_frozen() -> None:
    from policies import Decision

    d = Decision(k=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.k = 2  # type: ignore[misc]
