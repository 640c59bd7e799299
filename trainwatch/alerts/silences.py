"""Silences: label matchers that mute notifications and actions until they expire.

Persisted as one JSON document (atomically replaced) so that the CLI, the engine and
the webhook receiver share them; expired silences are kept for the record.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from trainwatch.contract.alerts import ACTS_BEFORE
from trainwatch.errors import ConfigError, FormatError
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.rundir.safe_read import read_run_file

FORMAT = "trainwatch.silences"


@dataclass
class Silence:
    id: str
    matchers: dict[str, str]
    starts_at: float
    ends_at: float
    comment: str = ""
    created_by: str = ""

    def active(self, t: float) -> bool:
        return self.starts_at <= t < self.ends_at

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.matchers.items())


def _silence(entry: object, index: int, path: str) -> Silence:
    """One stored silence, or a ConfigError naming it (a hand-edited file is input too)."""
    key = f"silences[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError("must be an object", file=path, key=key)
    matchers = entry.get("matchers")
    if not isinstance(matchers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in matchers.items()):
        raise ConfigError("matchers must map label names to strings", file=path, key=key)
    for name in ("starts_at", "ends_at"):
        value = entry.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number", file=path, key=key)
    text = {name: entry.get(name, "") for name in ("id", "comment", "created_by")}
    if not all(isinstance(v, str) for v in text.values()):
        raise ConfigError("id, comment and created_by must be strings", file=path, key=key)
    return Silence(text["id"], dict(matchers), float(entry["starts_at"]),
                   float(entry["ends_at"]), text["comment"], text["created_by"])


def parse_matchers(items: list[str]) -> dict[str, str]:
    """``alertname=TrainingStalled run=exp1`` -> dict; at least one, equality only."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"matcher '{item}' is not of the form label=value")
        out[key.strip()] = value.strip().strip('"')
    if not out:
        raise ConfigError("a silence needs at least one matcher, e.g. alertname=TrainingStalled")
    return out


class Silences:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self) -> list[Silence]:
        try:
            doc = json.loads(read_run_file(self.path))
        except FileNotFoundError:
            return []
        except (FormatError, ValueError, RecursionError) as exc:
            raise ConfigError(f"unreadable silences file: {exc}", file=str(self.path)) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ConfigError("not a trainwatch silences file", file=str(self.path))
        entries = doc.get("silences", [])
        if not isinstance(entries, list):
            raise ConfigError("'silences' must be a list", file=str(self.path), key="silences")
        return [_silence(entry, i, str(self.path)) for i, entry in enumerate(entries)]

    def _save(self, silences: list[Silence]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path, {"format": FORMAT, "version": 1,
                                      "silences": [asdict(s) for s in silences]})

    def add(self, matchers: dict[str, str], duration_s: float, comment: str = "",
            created_by: str = "", now: float | None = None) -> Silence:
        now = time.time() if now is None else now
        silence = Silence(uuid.uuid4().hex[:12], matchers, now, now + duration_s, comment,
                          created_by)
        self._save(self.load() + [silence])
        return silence

    def expire(self, silence_id: str, now: float | None = None) -> Silence:
        now = time.time() if now is None else now
        silences = self.load()
        for s in silences:
            if s.id == silence_id:
                s.ends_at = min(s.ends_at, now)
                self._save(silences)
                return s
        raise ConfigError(f"no silence with id {silence_id}", file=str(self.path))

    def matching(self, labels: dict[str, str], t: float) -> list[Silence]:
        """Active silences of these labels; an alert that acts before a page
        (``ACTS_BEFORE``) is also held by a silence of that page."""
        try:
            silences = self.load()
        except ConfigError:
            return []
        page = ACTS_BEFORE.get(labels.get("alertname", ""))
        also = {**labels, "alertname": page} if page else None
        return [s for s in silences if s.active(t)
                and (s.matches(labels) or (also is not None and s.matches(also)))]
