"""trainwatch.runbooks: one Markdown runbook per alert, shipped inside the package."""

from __future__ import annotations

from importlib import resources


def names() -> list[str]:
    """Alert names that have a runbook."""
    return sorted(p.name[:-3] for p in resources.files(__name__).iterdir()
                  if p.name.endswith(".md"))


def text(name: str) -> str | None:
    """The runbook of alert ``name`` (case-insensitive), or None."""
    match = {n.lower(): n for n in names()}.get(name.lower())
    if match is None:
        return None
    return resources.files(__name__).joinpath(f"{match}.md").read_text()
