"""``spectune export`` against each engine's own rules: what the engine needs to start (a draft model, a method, a
decoding type), how it reads the schedule back (vLLM's ranges, TensorRT-LLM's "up to key", SGLang's lower-bound
slots), and a round trip per format over every batch size from 1 to 512."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.cli import main as spectune
from controller.offline import export as ex
from controller.offline import project as pj
from telemetry.policy_table import policy_table_from_json
from telemetry.records import DEFAULT_BUCKETS, PolicyTable

FIXTURE_TABLE = Path(__file__).parent / "fixtures" / "policy_table.json"
DRAFT = "/models/draft-v1"
BATCH_SIZES = range(1, 513)
T, D = "target-v1", "draft-v1"
# k moves with the context bucket as well as the batch bucket (the --context-grid case): long contexts draft less
CTX_K = {"<=512": 6, "<=2048": 4, "<=8192": 3, ">8192": 1}
LARGE_BATCH_K = {16: 2, 32: 1}  # batches past 8 draft little whatever the context, past 32 not at all
CTX_TABLE = PolicyTable(version=2, default_k=2, k_max=6, entries={
    f"{T}|{D}|*|{bb}|{ctx}": CTX_K[ctx] if bb <= 8 else LARGE_BATCH_K.get(bb, 0)
    for bb in DEFAULT_BUCKETS.batch_edges for ctx in CTX_K
})


def projection(table: PolicyTable) -> tuple[pj.Traffic, pj.KFn, dict[int, int]]:
    traffic = pj.traffic_from_windows([], [], table)
    full = pj.table_k(table, traffic)
    return traffic, full, pj.project_batches(traffic, full)


@pytest.fixture
def fixture_table() -> PolicyTable:
    return policy_table_from_json(FIXTURE_TABLE.read_bytes())


# ------------------------------------------------------------------------------------ TensorRT-LLM
def test_trtllm_file_names_its_decoding_type_and_draft_model(fixture_table: PolicyTable) -> None:
    _, _, schedule = projection(fixture_table)
    out = ex.trtllm_export(schedule, draft_model=DRAFT)
    spec = yaml.safe_load(out.render())["speculative_config"]
    assert spec["decoding_type"] == "Draft_Target" and spec["speculative_model_dir"] == DRAFT
    assert all(isinstance(key, int) for key in spec["draft_len_schedule"])  # dict[int, int] in the YAML
    assert spec["max_draft_len"] == max(spec["draft_len_schedule"].values())
    ex.validate_trtllm(yaml.safe_load(out.render()))  # the file as written passes the rules
    ngram = ex.trtllm_export(schedule, decoding_type="NGram")  # NGram drafts from the prompt: no model
    assert yaml.safe_load(ngram.render())["speculative_config"]["decoding_type"] == "NGram"


def test_trtllm_without_a_draft_model_is_refused_or_marked(fixture_table: PolicyTable) -> None:
    _, _, schedule = projection(fixture_table)
    with pytest.raises(ex.ExportError, match="speculative_model must be specified"):
        ex.trtllm_export(schedule)
    bare = ex.trtllm_export(schedule, table_only=True)
    assert bare.notes[0].startswith("NOT STARTABLE AS IS")
    with pytest.raises(ex.ExportError, match="decoding-type"):
        ex.trtllm_export(schedule, draft_model=DRAFT, decoding_type="Draft/Target")


@pytest.mark.parametrize(("spec", "rule"), [
    ({"max_draft_len": 3, "draft_len_schedule": {1: 3}}, "Invalid decoding type: None"),
    ({"decoding_type": "Eagle7", "max_draft_len": 3, "draft_len_schedule": {1: 3}}, "Invalid decoding type"),
    ({"decoding_type": "Draft_Target", "max_draft_len": 3, "draft_len_schedule": {1: 3}}, "needs a draft model"),
    ({"decoding_type": "NGram", "max_draft_len": 3, "draft_len_schedule": {1: 3}, "max_concurrency": 8},
     "forbids unknown keys"),
    ({"decoding_type": "NGram", "max_draft_len": 3, "draft_len_schedule": {4: 2, 8: 1}}, "must equal max_draft_len"),
])
def test_trtllm_validators(spec: dict[str, Any], rule: str) -> None:
    with pytest.raises(ex.ExportError, match=rule):
        ex.validate_trtllm({"speculative_config": spec})


def test_trtllm_lookup_is_bisect_left_up_to_key() -> None:
    # tensorrt_llm/_torch/speculative/utils.py's docstring example: {4: 4, 8: 2, 32: 1}
    sched = {4: 4, 8: 2, 32: 1}
    assert [ex.trtllm_lookup(sched, b) for b in (1, 4, 5, 8, 9, 32, 33)] == [4, 4, 2, 2, 1, 1, 0]


def test_cli_trtllm_needs_the_draft_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "extra.yaml"
    assert spectune(["export", "trtllm", "--table", str(FIXTURE_TABLE), "--out", str(out)]) == 2
    assert "--draft-model" in capsys.readouterr().err and not out.exists()
    assert spectune(["export", "trtllm", "--table", str(FIXTURE_TABLE), "--draft-model", DRAFT,
                     "--out", str(out)]) == 0
    spec = yaml.safe_load(out.read_text())["speculative_config"]
    assert (spec["decoding_type"], spec["speculative_model_dir"]) == ("Draft_Target", DRAFT)


# ------------------------------------------------------------------------------------------ SGLang
def test_sglang_router_rule() -> None:
    """AdaptiveStepRouter.batch_size_key_for_batch on SGLang's DEFAULT_ADAPTIVE_CONFIG keys."""
    keys = [1, 8, 32, 64]
    assert [ex.sglang_adaptive_lookup(keys, b) for b in (1, 7, 8, 31, 32, 63, 64, 500)] == [1, 1, 8, 8, 32, 32, 64,
                                                                                            64]
    assert ex.sglang_adaptive_lookup(keys, 5, cuda_graph_bs=[1, 2, 4, 8, 16]) == 8  # padded to the graph first
    assert ex.sglang_adaptive_lookup(keys, 20, cuda_graph_bs=[1, 2, 4, 8, 16]) == 8  # past the graphs: unpadded


def test_sglang_adaptive_keys_are_lower_bounds(fixture_table: PolicyTable) -> None:
    traffic, full, schedule = projection(fixture_table)
    cands = {b: sorted({full(c[0], b, c[1]) for c in traffic.mix}) for b in traffic.batches}
    out = ex.sglang_adaptive_export(cands, schedule)
    cfg = json.loads(out.render())
    keys = sorted(int(k) for k in cfg)
    assert keys == [1, 2, 3, 5, 9, 17, 33, 65, 129]  # one past each edge before
    wrong = [b for b in range(1, 257)
             if cfg[str(ex.sglang_adaptive_lookup(keys, b))]["candidate_steps"] != cands[
                 DEFAULT_BUCKETS.batch_bucket(b)]]
    assert wrong == []
    upper_edges = sorted(schedule)  # the buckets' largest batch sizes, read by SGLang as lower bounds: misrouted
    assert any(schedule[ex.sglang_adaptive_lookup(upper_edges, b)] != ex.bucket_k(schedule, b) for b in range(1, 257))


# -------------------------------------------------------------------------------------------- vLLM
def test_vllm_without_a_draft_model_is_refused(fixture_table: PolicyTable) -> None:
    _, _, schedule = projection(fixture_table)
    with pytest.raises(ex.ExportError, match="without speculative model"):
        ex.vllm_export(schedule)
    with pytest.raises(ex.ExportError, match="without speculative model"):
        ex.vllm_export(schedule, base={"method": "eagle3"})  # eagle3 needs its head as the model
    out = ex.vllm_export(schedule, draft_model=DRAFT)
    assert (out.config["method"], out.config["model"]) == ("draft_model", DRAFT)
    assert ex.vllm_export(schedule, method="ngram").config["method"] == "ngram"  # model-free method
    bare = ex.vllm_export(schedule, table_only=True)
    assert "model" not in bare.config and bare.notes[0].startswith("NOT STARTABLE AS IS")


def test_cli_vllm_needs_a_model_or_table_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert spectune(["export", "vllm", "--table", str(FIXTURE_TABLE)]) == 2
    assert "without speculative model" in capsys.readouterr().err
    assert spectune(["export", "vllm", "--table", str(FIXTURE_TABLE), "--table-only"]) == 0
    out, err = capsys.readouterr()
    assert "model" not in json.loads(out) and "note: NOT STARTABLE AS IS" in err
    assert spectune(["export", "vllm", "--table", str(FIXTURE_TABLE), "--draft-model", DRAFT]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == DRAFT


def test_vllm_base_num_speculative_tokens_is_never_raised_silently(fixture_table: PolicyTable) -> None:
    _, _, schedule = projection(fixture_table)  # drafts up to 4
    with pytest.raises(ex.ExportError, match="num_speculative_tokens=2 but the table drafts up to k=4"):
        ex.vllm_export(schedule, base={"num_speculative_tokens": 2}, draft_model=DRAFT)
    kept = ex.vllm_export(schedule, base={"num_speculative_tokens": 6}, draft_model=DRAFT)
    assert kept.config["num_speculative_tokens"] == 6 and any("kept" in n for n in kept.notes)
    assert ex.vllm_export(schedule, base={"num_speculative_tokens": 4},
                          draft_model=DRAFT).config["num_speculative_tokens"] == 4


@pytest.mark.parametrize(("base", "rule"), [
    ({"modle": DRAFT}, r"\['modle'\] are refused \(they are not SpeculativeConfig fields"),
    ({"target_model_config": {}}, "vLLM fills them itself"),
    ({"num_speculative_tokens_per_batch_size": [[1, 8, 2]]}, "the exported table is that schedule"),
    ({"model": "/other"}, "give it once"),
    ({"method": "eagle9", "model": DRAFT}, "not one of vLLM 0.32's"),
])
def test_vllm_base_keys_are_checked(fixture_table: PolicyTable, base: dict[str, Any], rule: str) -> None:
    _, _, schedule = projection(fixture_table)
    with pytest.raises(ex.ExportError, match=rule) as e:
        ex.vllm_export(schedule, base=base, draft_model=DRAFT if "model" in base else None)
    if "refused" in rule:
        assert "valid keys: enforce_eager, num_speculative_tokens, model, method" in str(e.value)


def test_vllm_base_takes_dashed_keys_as_vllm_does(fixture_table: PolicyTable) -> None:
    _, _, schedule = projection(fixture_table)
    out = ex.vllm_export(schedule, base={"draft-tensor-parallel-size": 1}, draft_model=DRAFT)
    assert out.config["draft_tensor_parallel_size"] == 1


# ---------------------------------------------------------------------------- round trip per format
def test_round_trip_vllm(fixture_table: PolicyTable) -> None:
    _, _, schedule = projection(fixture_table)
    cfg = json.loads(ex.vllm_export(schedule, draft_model=DRAFT).render())
    rows = [tuple(r) for r in cfg["num_speculative_tokens_per_batch_size"]]
    n_spec = cfg["num_speculative_tokens"]
    assert [min(n_spec, ex.vllm_lookup(rows, b, "*")) for b in BATCH_SIZES] == [
        ex.bucket_k(schedule, b) for b in BATCH_SIZES]


def test_round_trip_vllm_context_grid() -> None:
    traffic, full, schedule = projection(CTX_TABLE)
    contexts = DEFAULT_BUCKETS.context_labels()
    grid = pj.project_grid(traffic, full, contexts)
    assert len({grid[(1, c)] for c in contexts}) > 1  # the grid does depend on the context
    out = ex.vllm_export(schedule, grid, contexts, draft_model=DRAFT)
    rows = [tuple(r) for r in json.loads(out.render())["num_speculative_tokens_per_batch_size"]]
    for ctx in contexts:
        by_batch = {b: grid[(b, ctx)] for b in traffic.batches}
        assert [ex.vllm_lookup(rows, b, ctx) for b in BATCH_SIZES] == [
            ex.bucket_k(by_batch, b) for b in BATCH_SIZES], ctx
    assert any("vLLM 0.32 rejects 5-item entries" in n for n in out.notes)


@pytest.mark.parametrize("max_batch_size", [None, 512])
def test_round_trip_trtllm(fixture_table: PolicyTable, max_batch_size: int | None) -> None:
    _, _, schedule = projection(fixture_table)
    out = ex.trtllm_export(schedule, max_batch_size, draft_model=DRAFT)
    sched = yaml.safe_load(out.render())["speculative_config"]["draft_len_schedule"]
    assert [ex.trtllm_lookup(sched, b) for b in BATCH_SIZES] == [ex.bucket_k(schedule, b) for b in BATCH_SIZES]


def test_round_trip_sglang() -> None:
    table = PolicyTable(version=3, default_k=3, k_max=4, entries={f"{T}|{D}|*|{bb}|*": 1 for bb in (64, 128, 256)})
    traffic, full, _ = projection(table)
    k = pj.best_k(traffic, full, traffic.batches)  # the one k a static SGLang server runs at: most batches' 3
    assert k == 3
    out = ex.sglang_export(k)
    steps = int(out.args[out.args.index("--speculative-num-steps") + 1])
    assert [steps for _ in BATCH_SIZES] == [k for _ in BATCH_SIZES]
    assert int(out.args[out.args.index("--speculative-num-draft-tokens") + 1]) == steps + 1


def test_round_trip_sglang_adaptive(fixture_table: PolicyTable) -> None:
    traffic, full, schedule = projection(fixture_table)
    cands = {b: sorted({full(c[0], b, c[1]) for c in traffic.mix}) for b in traffic.batches}
    out = ex.sglang_adaptive_export(cands, schedule)
    cfg = json.loads(out.render())
    keys = [int(k) for k in cfg]
    for b in BATCH_SIZES:
        slot = cfg[str(ex.sglang_adaptive_lookup(keys, b))]["candidate_steps"]
        assert ex.bucket_k(schedule, b) in slot, b
    assert [out.k_of("*", b, "*") for b in BATCH_SIZES] == [ex.bucket_k(schedule, b) for b in BATCH_SIZES]


def test_round_trip_hf(fixture_table: PolicyTable) -> None:
    _, _, schedule = projection(fixture_table)
    out = ex.hf_export(schedule[1])
    assert out.batches == (1,)  # assisted generation runs at batch size 1 only
    assert json.loads(out.render())["num_assistant_tokens"] == ex.bucket_k(schedule, 1)
