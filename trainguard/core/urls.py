"""URLs in logs, errors and files: shown without the parts that may be secret."""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["redact_url"]


def redact_url(url: str) -> str:
    """``scheme://host[:port]``, and ``/...`` where ``url`` had more: user info, path and query
    often carry a token (webhook paths, ``?token=``, ``user:password@``), so none is shown."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unparsable URL>"
    if ":" in host:
        host = f"[{host}]"
    rest = "/..." if parts.path.strip("/") or parts.query or parts.fragment else ""
    return f"{parts.scheme}://{host}{port}{rest}" if parts.scheme else "<URL>"
