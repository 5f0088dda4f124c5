"""URLs in logs, errors and files: shown without the parts that may be secret."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote, urlsplit

__all__ = ["redact_url", "scrub_secrets", "url_secrets", "userinfo_problem"]


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


_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


def userinfo_problem(url: str) -> str | None:
    """What makes the ``user:password@`` part of ``url`` unusable as written (None: nothing):
    a ``@`` or a ``%`` that is not percent-encoded, or an encoding that is not UTF-8. Never
    quotes the user info itself."""
    rest = url.partition("://")[2]
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    userinfo = netloc.rpartition("@")[0]
    if "@" in userinfo:
        return "its user info (user:password@) holds a '@' that is not percent-encoded (%40)"
    if "@" in rest and "@" not in netloc:
        return (
            "it has a '@' after the host: a '/', '?' or '#' in its user info must be "
            "percent-encoded (%2F, %3F, %23), and so must a '@' elsewhere (%40)"
        )
    if _BAD_PERCENT.search(userinfo):
        return "its user info (user:password@) holds a '%' that is not percent-encoded (%25)"
    try:
        unquote(userinfo, errors="strict")
    except UnicodeDecodeError:
        return "its user info (user:password@) is percent-encoded bytes that are not UTF-8"
    return None


def url_secrets(url: str) -> list[str]:
    """The secret parts of ``url`` as they may appear in a driver's message: the whole URL, its
    user info and each piece of it (raw and decoded: a password with a stray ``@`` splits
    there), and ``password=`` values of its query; longest first."""
    out = {url}
    rest = url.partition("://")[2]
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    pieces: list[str] = []
    # the user info as a URL parser reads it, and up to the last '@' (a password holding '/')
    for userinfo in (netloc.rpartition("@")[0], rest.rpartition("@")[0]):
        pieces += [userinfo, *userinfo.partition(":")[::2], *re.split(r"[:@/?#]", userinfo)]
    query = rest.partition("?")[2]
    pieces += [v for k, v in parse_qsl(query, keep_blank_values=True) if k.lower() == "password"]
    for p in pieces:
        out.update({p, unquote(p, errors="replace")})
    return sorted((s for s in out if s), key=len, reverse=True)


def scrub_secrets(text: str, secrets: list[str]) -> str:
    """``text`` with each of ``secrets`` (from :func:`url_secrets`) replaced by ``***``: every
    occurrence of one of 4 characters or more, a shorter one only where quoted whole."""
    for s in secrets:
        if len(s) >= 4:
            text = text.replace(s, "***")
        else:
            for q in ('"', "'"):
                text = text.replace(f"{q}{s}{q}", f"{q}***{q}")
    return text
