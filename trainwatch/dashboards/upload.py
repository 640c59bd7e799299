"""Upload dashboards to a Grafana server through its HTTP API (grafana-client).

The folder is found by title or created with a stable uid; each dashboard is posted with
``overwrite`` so its fixed uid replaces the previous upload.  The token only travels in
the Authorization header: it is never printed, and error messages are scrubbed of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException

from trainwatch import __version__
from trainwatch.config.yamlfile import read_secret
from trainwatch.contract.env import GRAFANA_TOKEN_ENV as TOKEN_ENV
from trainwatch.errors import EXIT_PROBLEM, ConfigError, TrainwatchError



class UploadError(TrainwatchError):
    """Grafana could not be reached or refused the upload."""

    exit_code = EXIT_PROBLEM


@dataclass
class Uploaded:
    uid: str
    title: str
    url: str
    version: int | None


def read_token(token_file: str | None) -> str:
    """From ``--token-file`` or $TRAINWATCH_GRAFANA_TOKEN."""
    return read_secret(token_file, TOKEN_ENV,
                       f"no Grafana token: set {TOKEN_ENV} or give --token-file FILE "
                       "(a service account token with Editor rights on the folder)")


def check_url(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"'{url}' is not an http(s) URL of a Grafana server", key="--url")
    if parsed.username or parsed.password:
        raise ConfigError(f"put credentials in --token-file or ${TOKEN_ENV}, not in the URL",
                          key="--url")
    # grafana-client appends "api" to the path: a sub-path must end with "/".
    return url if url.endswith("/") else url + "/"


def folder_uid(title: str) -> str:
    """Stable uid for a folder we create, so a second upload finds the same one."""
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "folder"
    return slug[:40]


class Uploader:
    def __init__(self, url: str, token: str, timeout: float = 10.0):
        self.url = check_url(url)
        self._token = token
        self.api = GrafanaApi.from_url(self.url, credential=token, timeout=timeout)

    def _call(self, what: str, fn, *args: Any) -> Any:
        try:
            return fn(*args)
        except GrafanaClientError as exc:
            if exc.status_code in (401, 403):
                raise ConfigError(f"Grafana at {self.url} refused the token while trying to "
                                  f"{what} (HTTP {exc.status_code} {exc.message}): check "
                                  f"${TOKEN_ENV} / --token-file and the token's role "
                                  "(Editor)") from None
            raise UploadError(self._scrub(f"Grafana at {self.url} refused to {what}: "
                                          f"{exc.message}")) from None
        except GrafanaException as exc:
            raise UploadError(self._scrub(f"Grafana at {self.url} failed to {what}: "
                                          f"{exc.message}")) from None
        except OSError as exc:  # connection refused, DNS, TLS: niquests errors are OSErrors
            raise UploadError(self._scrub(f"cannot reach Grafana at {self.url} to {what}: "
                                          f"{exc}")) from None

    def _scrub(self, text: str) -> str:
        """Hide the token if an error message echoes it (a token of a few characters
        would only garble the message: every occurrence of those letters)."""
        return text.replace(self._token, "***") if len(self._token) >= 8 else text

    def ensure_folder(self, title: str) -> str:
        """The uid of the folder titled ``title``, created if missing."""
        folders = self._call("list folders", self.api.folder.get_all_folders)
        for folder in folders or []:
            if folder.get("title") == title:
                return folder["uid"]
        created = self._call(f"create folder '{title}'", self.api.folder.create_folder,
                             title, folder_uid(title))
        return created["uid"]

    def upload(self, dashboards: list[dict[str, Any]], folder: str) -> list[Uploaded]:
        uid = self.ensure_folder(folder)
        done = []
        for dashboard in dashboards:
            body = {"dashboard": {**dashboard, "id": None}, "folderUid": uid,
                    "overwrite": True, "message": f"trainwatch {__version__} dashboards upload"}
            answer = self._call(f"save dashboard {dashboard.get('uid')}",
                                self.api.dashboard.update_dashboard, body)
            done.append(Uploaded(dashboard.get("uid", ""), dashboard.get("title", ""),
                                 answer.get("url", ""), answer.get("version")))
        return done
