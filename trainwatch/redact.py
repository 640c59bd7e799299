"""Remove secrets (tokens, keys, passwords) from everything trainwatch prints, reports or
bundles (diagnose, preflight).

Two nets: by key name (``WANDB_API_KEY=...``, ``"password": ...``, ``token: ...``)
and by value shape (bearer tokens, cloud keys, private-key blocks, URL
credentials, JWTs), so a secret is caught in structured data and in free text.
"""

from __future__ import annotations

import functools
import re
from typing import Any

MASK = "[REDACTED]"

SECRET_KEY = re.compile(
    r"(pass(word|wd|phrase)?|secret|token(?!s|iz)|api[_-]?key|access[_-]?key|private[_-]?key|"
    r"credential|auth|session[_-]?key|cookie|signature|\bpwd\b)", re.I)

_VALUE_PATTERNS = [
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.S),
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),                       # AWS access key id
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}\b"),                    # GitHub tokens
    re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b"),                 # Slack tokens
    re.compile(r"\b(sk|hf|pk|rk)[-_][A-Za-z0-9_-]{16,}\b"),           # OpenAI / HF style keys
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\b"),  # JWT
]
# scheme://user:password@host -> keep the user, hide the password
_URL_CREDENTIALS = re.compile(r"(?P<pre>[a-z][a-z0-9+.-]*://[^/\s:@]+:)[^@\s/]+(?=@)", re.I)
# KEY=value, KEY: value, "key": "value" in free text, for secret-looking keys
_KEY_VALUE = re.compile(
    r"(?P<key>[\"']?[A-Za-z0-9_.-]*" + SECRET_KEY.pattern[1:-1].replace("\\b", "") +
    r"[A-Za-z0-9_.-]*[\"']?)(?P<sep>\s*[=:]\s*|\s+)(?P<q>[\"']?)(?P<value>[^\s\"',;}]+)",
    re.I)


def redact_text(text: str) -> str:
    for pattern in _VALUE_PATTERNS:
        text = pattern.sub(MASK, text)
    text = _URL_CREDENTIALS.sub(lambda m: m["pre"] + MASK, text)

    def by_key(m: re.Match[str]) -> str:
        if m["sep"].strip() == "" and not m["q"]:
            return m[0]  # "token expired" is prose, not a key and value
        return f"{m['key']}{m['sep']}{m['q']}{MASK}"
    return _KEY_VALUE.sub(by_key, text)


@functools.lru_cache(maxsize=1 << 16)
def _redact_short(text: str) -> str:
    return redact_text(text)


@functools.lru_cache(maxsize=4096)
def _secret_key(key: str) -> bool:
    return bool(SECRET_KEY.search(key))


def redact(obj: Any) -> Any:
    """A copy of ``obj`` (JSON-like data) with secret-named values and secret-shaped text masked.

    Evidence repeats the same short strings (states, phases, node names) thousands of
    times at scale; those are masked once and remembered.
    """
    if isinstance(obj, dict):
        return {k: (MASK if isinstance(k, str) and _secret_key(k)
                    and isinstance(v, (str, int, float)) and v not in ("", None)
                    else redact(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return _redact_short(obj) if len(obj) <= 256 else redact_text(obj)
    return obj


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (MASK if SECRET_KEY.search(k) and v else redact_text(v)) for k, v in env.items()}
