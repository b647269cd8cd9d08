"""Import direction (docs DESIGN.md, "Boxes and arrows"): who may import whom, read from the source with ``ast``.

Product code is what the wheel ships: ``engine``, ``telemetry``, ``policies``, ``controller``, ``migrations``. It
never imports ``bench`` (benchmarks import product code, never the other way round) or ``tests``. Among product
packages: ``engine``, ``policies`` and ``migrations`` import only ``telemetry``; ``telemetry`` imports none of the
others; ``controller`` may import everything and nothing imports it.

Only import statements are read. ``spectune bench NAME`` looks its benchmark up by name at run time in a source
checkout; that lookup is checked here too, with ``bench`` absent from the installed packages.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

from controller.cli import main

REPO = Path(__file__).resolve().parents[1]
# product package -> the other product packages it may import
ALLOWED = {
    "engine": {"telemetry"},
    "telemetry": set(),
    "policies": {"telemetry"},
    "migrations": {"telemetry"},
    "controller": {"engine", "telemetry", "policies", "migrations"},
}
NOT_PRODUCT = ("bench", "tests")  # in the repository, never in the wheel


def imported_top_levels(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in ``path``, at any depth (lazy imports too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def test_product_code_imports_only_along_the_design_arrows() -> None:
    product = set(ALLOWED)
    wrong = []
    for pkg, allowed in ALLOWED.items():
        files = sorted((REPO / pkg).rglob("*.py"))
        assert files, f"no sources under {pkg}/"
        for f in files:
            for line, top in imported_top_levels(f):
                if top in NOT_PRODUCT or (top in product and top != pkg and top not in allowed):
                    wrong.append(f"{f.relative_to(REPO)}:{line} imports {top}")
    assert not wrong, "imports against DESIGN.md's arrows:\n" + "\n".join(wrong)


def test_the_wheel_does_not_ship_bench() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = setuptools["packages"]["find"]["include"]
    assert set(include) == {f"{p}*" for p in ALLOWED}, include


def test_bench_runs_from_the_checkout_without_being_installed(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    root = REPO.resolve()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != root])
    for name in [m for m in sys.modules if m == "bench" or m.startswith("bench.")]:
        monkeypatch.delitem(sys.modules, name)
    if importlib.util.find_spec("bench") is not None:
        pytest.skip("the installed spectune still maps bench/ (an editable install made before bench left the "
                    "wheel): rerun `pip install -e .`")
    with pytest.raises(SystemExit) as e:
        main(["bench", "tuning", "--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out
