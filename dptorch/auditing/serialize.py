"""An audit's result as a dict or JSON: its fields, its verdict, infinite bounds as null."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any, Dict


def json_safe(value: Any) -> Any:
    """Infinite floats as None (JSON has no infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class Serializable:
    """For an audit result dataclass with a ``consistent`` property."""

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)  # type: ignore[call-overload]
        out["consistent"] = self.consistent  # type: ignore[attr-defined]
        return json_safe(out)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)
