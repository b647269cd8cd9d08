"""What every benchmark does at the end: write the JSON, draw the PNG beside it, print the table."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_results(
    doc: dict[str, Any],
    path: str | Path,
    plot: Callable[[dict[str, Any], Path], None],
    table: Callable[[dict[str, Any]], None],
) -> Path:
    """Save ``doc`` as JSON at ``path``, its plot as PNG next to it, print its table. Returns the PNG path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    png = out.with_suffix(".png")
    plot(doc, png)
    table(doc)
    print(f"wrote {out} and {png}")
    return png
