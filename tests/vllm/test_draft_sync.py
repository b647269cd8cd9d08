"""Lazy draft KV sync: its bookkeeping alone, and a real vLLM whose acceptance it must leave as vLLM's own."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from controller.engines.vllm.cli import config_from_argv
from controller.engines.vllm.draft_sync import MODE_ENV, SyncState, mode_from_env, pack
from controller.engines.vllm.serve import VllmServeConfig, ensure_models, vllm_environment

PROBE = Path(__file__).with_name("draft_sync_probe.py")
REPO = Path(__file__).resolve().parents[2]


def test_a_skipped_step_leaves_each_request_stale_from_its_first_unwritten_position() -> None:
    s = SyncState()
    s.skip([("a", 10, 1), ("b", 40, 4)])
    s.skip([("a", 11, 1), ("b", 44, 1)])
    assert s.stale_from == {"a": 10, "b": 40}
    assert (s.skipped_steps, s.skipped_tokens) == (2, 7)
    # drafting resumes at a: 12, b: 45; c joined after the skips with no cached prefix (start 0)
    ranges = s.catch_up([("a", 12, 1), ("c", 0, 30), ("b", 45, 1)])
    assert ranges == [(0, 10, 12), (2, 40, 45)]
    assert s.stale_from == {} and s.caught_up_tokens == 7
    assert s.catch_up([("a", 13, 1), ("b", 46, 1)]) == []  # in step again


def test_after_a_skip_a_request_met_past_position_0_catches_up_its_cached_prefix() -> None:
    s = SyncState()
    assert s.catch_up([("a", 64, 5)]) == []  # no skip yet: every cached block was written by the draft
    s.skip([("a", 69, 1)])
    assert s.catch_up([("a", 70, 1), ("p", 64, 5)]) == [(0, 69, 70), (1, 0, 64)]


def test_a_preempted_request_recomputed_from_the_start_needs_no_catch_up() -> None:
    s = SyncState()
    s.skip([("a", 30, 1)])
    assert s.catch_up([("a", 0, 31)]) == []  # vLLM recomputes it whole this step: the draft's pass covers it
    assert s.stale_from == {}


def test_finished_requests_are_forgotten() -> None:
    s = SyncState()
    s.skip([("a", 3, 1), ("b", 5, 1)])
    s.forget_finished({"b"})
    assert s.stale_from == {"b": 5} and s.seen == {"b"}


def test_catch_up_is_packed_into_forwards_within_the_token_budget() -> None:
    assert pack([(0, 0, 5), (1, 10, 12)], 8) == [[(0, 0, 5), (1, 10, 12)]]
    assert pack([(0, 0, 10), (1, 3, 5)], 4) == [[(0, 0, 4)], [(0, 4, 8)], [(0, 8, 10), (1, 3, 5)]]
    for forwards in (pack([(0, 0, 7), (1, 0, 9), (2, 5, 6)], 5),):
        assert all(sum(b - a for _, a, b in f) <= 5 for f in forwards)
        assert all(len({r for r, _, _ in f}) == len(f) for f in forwards)  # a row once per forward
    with pytest.raises(ValueError):
        pack([(0, 0, 1)], 0)


def test_the_mode_comes_from_the_environment_and_a_bad_one_is_refused() -> None:
    assert mode_from_env({}) == "eager"
    assert mode_from_env({MODE_ENV: " Lazy "}) == "lazy"
    with pytest.raises(ValueError, match="expected one of eager, lazy"):
        mode_from_env({MODE_ENV: "sometimes"})


def test_spectune_vllm_serve_runs_lazy_sync_unless_told_otherwise() -> None:
    cfg = config_from_argv(["serve", "--no-telemetry"], "redis://127.0.0.1:6379/0")
    assert cfg.draft_sync == "lazy" and vllm_environment(cfg, {})[MODE_ENV] == "lazy"
    eager = config_from_argv(["serve", "--no-telemetry", "--draft-sync", "eager"], "redis://127.0.0.1:6379/0")
    assert vllm_environment(eager, {MODE_ENV: "lazy"})[MODE_ENV] == "eager"  # the flag wins over the environment
    with pytest.raises(ValueError, match="--draft-sync"):
        VllmServeConfig(draft_sync="never")


@pytest.fixture(scope="module")
def probe_runs(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list]]:  # type: ignore[type-arg]
    """The probe's greedy requests under one on/off k schedule, with each sync mode, in a real vLLM."""
    models = ensure_models("small", tmp_path_factory.mktemp("models"), say=lambda *_: None)
    env = vllm_environment(VllmServeConfig(vllm_python=vllm_python), os.environ)
    env.pop(MODE_ENV)  # the probe installs its mode itself
    out = {}
    for mode in ("eager", "lazy", "nocatchup"):
        p = subprocess.run([str(vllm_python), str(PROBE), mode, str(models.target), str(models.draft)], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=600)
        lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"{mode}: {p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        out[mode] = json.loads(lines[-1][len("RESULT "):])
    return out


def test_lazy_sync_drafts_and_accepts_exactly_what_vllms_own_sync_does(probe_runs: dict[str, dict[str, list]]  # type: ignore[type-arg]
                                                                       ) -> None:
    eager, lazy = probe_runs["eager"], probe_runs["lazy"]
    assert any(k == 0 for k, _, _ in eager["steps"]) and any(k > 0 for k, _, _ in eager["steps"])
    assert lazy["tokens"] == eager["tokens"]
    # per step (k set, drafts verified, drafts accepted): the draft's cache after catch-up is the one eager sync left
    assert lazy["steps"] == eager["steps"]


def test_lazy_sync_runs_vllms_plain_path_in_steps_with_nothing_to_verify_or_propose(
        probe_runs: dict[str, dict[str, list]]) -> None:  # type: ignore[type-arg]
    lazy, eager = probe_runs["lazy"], probe_runs["eager"]
    plain = sum(1 for k, drafted, _ in lazy["steps"] if k == 0 and drafted == 0)
    verify_only = sum(1 for k, drafted, _ in lazy["steps"] if k == 0 and drafted > 0)  # drafts verified, none made
    assert plain > 0 and verify_only > 0
    assert lazy["plain_steps"] == plain
    assert lazy["skipped_steps"] == plain + verify_only  # the draft ran in no step with k = 0
    assert eager["plain_steps"] == eager["skipped_steps"] == 0


def test_skipping_the_draft_without_catching_up_loses_acceptance(probe_runs: dict[str, dict[str, list]]  # type: ignore[type-arg]
                                                                 ) -> None:
    def rate(run: dict[str, list]) -> float:  # type: ignore[type-arg]
        return sum(a for _, _, a in run["steps"]) / sum(d for _, d, _ in run["steps"])

    eager, stale = probe_runs["eager"], probe_runs["nocatchup"]
    assert stale["tokens"] == eager["tokens"]  # the target's output never depends on the draft
    assert rate(stale) < rate(eager) - 0.02  # measured: 0.586 against 0.647
