"""What the commands print with: counts, rates, sizes and JSON, each said one way."""
from __future__ import annotations

import json
from typing import Any

from ..server_view import mib

__all__ = ["gbps", "mib", "plural", "print_json"]


def plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"
