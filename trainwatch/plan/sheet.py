"""Every number of a plan with its formula and inputs, so ``--explain`` can show its working."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Quantity:
    value: Any
    unit: str
    formula: str
    inputs: dict[str, Any] = field(default_factory=dict)


class Sheet:
    """Quantities by section and key, in the order they were worked out."""

    def __init__(self) -> None:
        self.sections: dict[str, dict[str, Quantity]] = {}

    def add(self, section: str, key: str, value: Any, unit: str, formula: str,
            **inputs: Any) -> Any:
        self.sections.setdefault(section, {})[key] = Quantity(value, unit, formula, inputs)
        return value

    def value(self, section: str, key: str) -> Any:
        return self.sections[section][key].value

    def values(self) -> dict[str, dict[str, Any]]:
        return {s: {k: q.value for k, q in items.items()} for s, items in self.sections.items()}

    def explain(self) -> dict[str, dict[str, Any]]:
        return {f"{s}.{k}": {"unit": q.unit, "formula": q.formula, "inputs": q.inputs}
                for s, items in self.sections.items() for k, q in items.items()}
