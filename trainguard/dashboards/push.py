"""Push the generated dashboards to a Grafana server through its HTTP API (grafana-client).

Idempotent: each dashboard keeps its uid and is posted with ``overwrite: true`` (same uid →
update); the folder is looked up by uid and created only when missing. The API token comes
from the environment or a file, never from the command line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainguard.core.contracts import envvars
from trainguard.core.urls import redact_url

__all__ = ["TOKEN_ENV", "PushError", "PushResult", "push_dashboards", "read_token"]

TOKEN_ENV = envvars.GRAFANA_TOKEN
FOLDER_UID = "trainguard"
FOLDER_TITLE = "trainguard"


class PushError(RuntimeError):
    """The push failed; the message says what, where and how to fix it."""


@dataclass(frozen=True, slots=True)
class PushResult:
    folder_uid: str
    folder_created: bool
    dashboards: dict[str, str]
    """uid → URL path Grafana reports for it."""


def read_token(token_file: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The API token: ``token_file``'s first line, else ``$TRAINGUARD_GRAFANA_TOKEN``, else None."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise PushError(f"cannot read the token file {token_file}: {e.strerror}") from None
        if not token:
            raise PushError(
                f"the token file {token_file} is empty: put the Grafana API token in it"
            )
        return token.splitlines()[0]
    env = os.environ if env is None else env
    return env.get(TOKEN_ENV) or None


def _ensure_folder(api: Any, uid: str, title: str) -> bool:
    from grafana_client.client import GrafanaClientError

    try:
        api.folder.get_folder(uid)
        return False
    except GrafanaClientError as e:
        if e.status_code != 404:
            raise
    api.folder.create_folder(title, uid=uid)
    return True


def _api(url: str, token: str | None, timeout_s: float, verify_tls: bool) -> Any:
    """grafana-client's API for ``url``, built from its parts: ``GrafanaApi.from_url`` would
    take ``user:password@`` as credentials and ``?verify=false`` as an order to skip TLS
    verification, silently. Both are refused here (a password on the command line shows in
    ``ps`` and the shell's history; skipping verification is ``--insecure``, said out loud)."""
    from grafana_client import GrafanaApi

    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise PushError(f"--url {shown}: not a URL (e.g. https://grafana:3000)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PushError(f"--url {shown}: use http(s)://HOST[:PORT][/PATH]")
    if parts.username or parts.password:
        raise PushError(
            f"--url {shown}: credentials in the URL are refused (they show in ps and the "
            f"shell's history): put the API token in ${TOKEN_ENV} or --token-file"
        )
    if parts.query or parts.fragment:
        raise PushError(
            f"--url {shown}: no query string (to skip TLS verification, which ?verify=false "
            "asked for, pass --insecure)"
        )
    return GrafanaApi(
        token,
        protocol=parts.scheme,
        host=parts.hostname,
        port=port,
        url_path_prefix=parts.path.strip("/"),
        verify=verify_tls,
        timeout=timeout_s,
    )


def push_dashboards(
    url: str,
    token: str | None,
    dashboards: dict[str, str],
    *,
    folder_uid: str = FOLDER_UID,
    folder_title: str = FOLDER_TITLE,
    timeout_s: float = 30.0,
    verify_tls: bool = True,
) -> PushResult:
    """Post each dashboard JSON text of ``dashboards`` (name → text) into the folder.
    Errors never show more of ``url`` than its scheme, host and port."""
    from grafana_client.client import GrafanaException
    from requests.exceptions import RequestException

    shown = redact_url(url)
    api = _api(url, token, timeout_s, verify_tls)
    try:
        created = _ensure_folder(api, folder_uid, folder_title)
        out: dict[str, str] = {}
        for text in dashboards.values():
            model = json.loads(text)
            model.pop("id", None)  # the uid identifies it across Grafana instances
            r = api.dashboard.update_dashboard(
                {
                    "dashboard": model,
                    "folderUid": folder_uid,
                    "overwrite": True,
                    "message": "trainguard dashboards push",
                }
            )
            out[model["uid"]] = str((r or {}).get("url", ""))
    except GrafanaException as e:
        hint = " (check the token)" if e.status_code in (401, 403) else ""
        raise PushError(f"Grafana at {shown} refused the push: {e.message}{hint}") from None
    except RequestException as e:
        # requests' own text names the host and path only (no credentials reach it)
        raise PushError(f"cannot reach Grafana at {shown}: {type(e).__name__}: {e}") from None
    return PushResult(folder_uid, created, out)
