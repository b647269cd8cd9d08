"""``spectune vllm serve`` turned into vLLM's command line, without starting vLLM: steered, or an exported table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.engines.vllm.cli import read_speculative_config
from controller.engines.vllm.serve import SCHEDULER_CLS, ServedModels, VllmError, VllmServeConfig, vllm_command

MODELS = ServedModels(Path("/m/target-v1"), Path("/m/draft-v1"), "target-v1", "draft-v1")


def spec_of(cmd: list[str]) -> dict[str, object]:
    return json.loads(cmd[cmd.index("--speculative-config") + 1])  # type: ignore[no-any-return]


def test_steered_serving_uses_spectunes_scheduler_and_the_profiles_draft() -> None:
    cmd = vllm_command(VllmServeConfig(k_max=5, redis_url="redis://127.0.0.1:6379/0"), MODELS)
    assert SCHEDULER_CLS in cmd
    assert spec_of(cmd) == {"method": "draft_model", "model": "/m/draft-v1", "num_speculative_tokens": 5}


def test_the_cost_of_mixed_steps_setting_reaches_the_scheduler() -> None:
    from controller.engines.vllm.cli import config_from_argv

    def spectune_of(cmd: list[str]) -> dict[str, object]:
        return json.loads(cmd[cmd.index("--additional-config") + 1])["spectune"]  # type: ignore[no-any-return]

    for argv, want in ((["serve"], False), (["serve", "--cost-mixed-steps"], True)):
        cfg = config_from_argv(argv, "redis://127.0.0.1:6379/0")
        assert cfg.cost_mixed_steps is want
        assert spectune_of(vllm_command(cfg, MODELS))["cost_mixed_steps"] is want


def test_an_exported_table_goes_to_vllm_as_it_is_without_steering(tmp_path: Path) -> None:
    exported = {"num_speculative_tokens": 5, "num_speculative_tokens_per_batch_size": [[1, 2, 5], [3, 256, 0]]}
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(exported))
    spec = read_speculative_config(f)
    cfg = VllmServeConfig(steer=False, speculative_config=spec, k_max=5, extra_args=("--max-num-seqs", "8"))
    cmd = vllm_command(cfg, MODELS)
    assert SCHEDULER_CLS not in cmd and "--additional-config" not in cmd
    assert spec_of(cmd) == exported | {"method": "draft_model", "model": "/m/draft-v1"}  # the profile's draft
    assert cmd[-2:] == ["--max-num-seqs", "8"]  # the operator's flags still come last


@pytest.mark.parametrize(("text", "words"), [
    ("{", "cannot read"),
    (json.dumps({"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 8, 5]]}),
     "not one vLLM accepts"),
    (json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                 "num_speculative_tokens_per_batch_size": [[1, 8, 3]]}), "draft_model"),
])
def test_a_config_vllm_would_refuse_is_refused_before_starting(tmp_path: Path, text: str, words: str) -> None:
    f = tmp_path / "spec.json"
    f.write_text(text)
    with pytest.raises(VllmError, match=words):
        read_speculative_config(f)


def test_an_exported_table_cannot_be_steered_at_the_same_time() -> None:
    with pytest.raises(ValueError, match="steer=False"):
        VllmServeConfig(speculative_config={"num_speculative_tokens": 3})


def test_the_command_line_with_an_exported_table(tmp_path: Path) -> None:
    from controller.engines.vllm.cli import config_from_argv

    f = tmp_path / "spec.json"
    f.write_text(json.dumps({"method": "draft_model", "model": "/m/draft-v1", "num_speculative_tokens": 3,
                             "num_speculative_tokens_per_batch_size": [[1, 256, 3]]}))
    cfg = config_from_argv(["serve", "--profile", "small", "--speculative-config", str(f), "--port", "8011",
                            "--enforce-eager"], "redis://127.0.0.1:6379/0")
    assert (cfg.steer, cfg.redis_url, cfg.k_max, cfg.extra_args) == (False, None, 3, ("--enforce-eager",))
    assert spec_of(vllm_command(cfg, MODELS))["num_speculative_tokens_per_batch_size"] == [[1, 256, 3]]
    steered = config_from_argv(["serve", "--k-max", "5"], "redis://127.0.0.1:6379/0")
    assert (steered.steer, steered.redis_url, steered.k_max) == (True, "redis://127.0.0.1:6379/0", 5)
    with pytest.raises(VllmError, match="whole schedule"):
        config_from_argv(["serve", "--speculative-config", str(f), "--fixed-k", "2"], "redis://x")
