"""A small JSON-over-HTTP GET with a timeout, for agents and Prometheus."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


def get_json(url: str, timeout: float, params: dict[str, str] | None = None) -> Any:
    """GET ``url`` and parse JSON; raises OSError/ValueError with a readable message."""
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # user's URL
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise OSError(f"HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise OSError(str(exc.reason)) from None
    except TimeoutError:
        raise OSError(f"no answer within {timeout:g} s") from None
