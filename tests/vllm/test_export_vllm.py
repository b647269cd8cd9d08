"""``spectune export vllm`` checked by vLLM 0.32 itself: the exported ``--speculative-config`` goes through
``EngineArgs.create_speculative_config`` (so ``SpeculativeConfig``'s validators run) with spectune's exported
draft model, and the scheduler's own table builder (``build_dynamic_sd_schedule_lookup``, which
``Scheduler.__init__`` turns into ``dynamic_sd_lookup``) gives the same k as spectune for batch sizes 1..512."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from controller.cli import main as spectune
from controller.engines.vllm.serve import ensure_models
from controller.offline import export as ex
from controller.offline import project as pj
from telemetry.policy_table import policy_table_from_json

FIXTURE_TABLE = Path(__file__).parents[1] / "offline" / "fixtures" / "policy_table.json"
MAX_NUM_SEQS = 512  # the scheduler's vllm_max_batch_size: the dense table covers batch sizes 1..512
VLLM_CHECK_S = 300  # importing vLLM takes ~15 s on an idle machine, several times that on two busy cores

# Runs in vLLM's environment: each config through vLLM's own validation, then the scheduler's table builder.
CHECK = """
import json, sys
from vllm.config import ModelConfig, ParallelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

target, max_num_seqs, configs = sys.argv[1], int(sys.argv[2]), json.loads(open(sys.argv[3]).read())
model_config = ModelConfig(model=target)
out = {}
for name, cfg in configs.items():
    try:
        spec = EngineArgs(model=target, speculative_config=cfg).create_speculative_config(
            model_config, ParallelConfig())
        dense = build_dynamic_sd_schedule_lookup(
            spec.num_speculative_tokens_per_batch_size, vllm_max_batch_size=max_num_seqs,
            vllm_num_speculative_tokens=spec.num_speculative_tokens)
        out[name] = {"method": spec.method, "model": spec.model, "dense": dense}
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"}
print("RESULT " + json.dumps(out))
"""


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert spectune(["export", "vllm", "--table", str(FIXTURE_TABLE), *args]) == 0
    return dict(json.loads(capsys.readouterr().out))


@pytest.mark.slow
def test_exported_vllm_config_passes_vllms_own_validation(vllm_python: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    models = ensure_models("small", tmp_path / "models", say=lambda *_: None)  # this test's own export
    configs = {
        "draft_model": _export(capsys, "--draft-model", str(models.draft)),
        "table_only": _export(capsys, "--table-only"),
        "context_grid": _export(capsys, "--draft-model", str(models.draft), "--context-grid"),
    }
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(configs))
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    run = subprocess.run([str(vllm_python), str(script), str(models.target), str(MAX_NUM_SEQS), str(path)],
                         capture_output=True, text=True, timeout=VLLM_CHECK_S, check=False)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, run.stderr[-3000:]
    result = json.loads(line.removeprefix("RESULT "))

    ok = result["draft_model"]
    assert "error" not in ok, ok
    assert (ok["method"], ok["model"]) == ("draft_model", str(models.draft))
    table = policy_table_from_json(FIXTURE_TABLE.read_bytes())
    traffic = pj.traffic_from_windows([], [], table)
    schedule = pj.project_batches(traffic, pj.table_k(table, traffic))
    rows = [tuple(r) for r in configs["draft_model"]["num_speculative_tokens_per_batch_size"]]
    batch_sizes = range(1, MAX_NUM_SEQS + 1)
    assert [ok["dense"][b] for b in batch_sizes] == [ex.bucket_k(schedule, b) for b in batch_sizes]
    assert [ok["dense"][b] for b in batch_sizes] == [ex.vllm_lookup(rows, b, "*") for b in batch_sizes]

    # what spectune refuses without --table-only, vLLM refuses too
    assert "without speculative model" in result["table_only"]["error"]
    # and the 5-item schedule is for a context-aware vLLM, as the export's note says: 0.32 refuses it
    grid_error = result["context_grid"]["error"]
    assert "num_speculative_tokens_per_batch_size" in grid_error and "at most 3 items" in grid_error, grid_error
