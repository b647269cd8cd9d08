"""The demo in quick mode: the real engine, the sidecar learning live, the report folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller import demo


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
