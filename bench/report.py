"""Where benchmark results go: one JSON line, printed and written under bench/results/."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def rounded(obj):
    """Floats to 4 significant digits, through dicts and lists."""
    if isinstance(obj, float):
        return float(f"{obj:.4g}")
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v) for v in obj]
    return obj


def write_result(result: dict, path: Path) -> None:
    """Print the result as one JSON line and write the same line to `path`."""
    line = json.dumps(rounded(result))
    print(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(line + "\n")
