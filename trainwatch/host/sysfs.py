"""Small readers for sysfs-style files: absent, unreadable or "N/A" values are None."""

from __future__ import annotations

from pathlib import Path


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def read_int(path: Path) -> int | None:
    text = read_text(path)
    if text is None or text.upper() in ("N/A", ""):
        return None
    try:
        return int(text, 0) if text.startswith("0x") else int(text)
    except ValueError:
        return None
