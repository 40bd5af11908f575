"""URLs fit to show: logs, error messages, CLI tables and JSON never carry a credential.

``redact_url("redis://user:pw@host:6379/0?password=pw&db=0")`` gives
``"redis://user:***@host:6379/0?password=***&db=0"``: the password of the userinfo part and the
value of every query parameter whose name looks like a credential (password, passwd, pwd, token,
secret, auth, credential, api key, access key, signature) are replaced; the rest of the URL stays
as it was written (no re-encoding, ``unix:///`` keeps its slashes).
"""

from __future__ import annotations

MASK = "***"
SECRET_WORDS = ("pass", "pwd", "token", "secret", "auth", "credential", "apikey", "api_key", "api-key",
                "access_key", "accesskey", "signature", "sig")


def is_secret_name(name: str) -> bool:
    """Whether a query parameter named ``name`` holds a credential."""
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def redact_url(url: object) -> str:
    """``url`` with its userinfo password and credential-like query values as ``***``."""
    text = str(url)
    head, sep, query = text.partition("?")
    return _hide_userinfo_password(head) + sep + _hide_query_secrets(query)


def _hide_userinfo_password(head: str) -> str:
    scheme, sep, rest = head.partition("://")
    if not sep:
        return head
    netloc, slash, path = rest.partition("/")
    userinfo, at, host = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return head
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:{MASK}@{host}{slash}{path}"


def _hide_query_secrets(query: str) -> str:
    query, hash_, fragment = query.partition("#")
    parts = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        parts.append(f"{name}={MASK}" if eq and is_secret_name(name) else item)
    return "&".join(parts) + hash_ + fragment


def redact_text(text: str, url: object) -> str:
    """``text`` with every secret of ``url`` (and ``url`` itself) replaced: for messages that
    may quote a URL they did not get through :func:`redact_url` (a child's stderr, a library's
    exception)."""
    raw = str(url)
    out = text.replace(raw, redact_url(raw))
    for secret in secrets_of(raw):
        out = out.replace(secret, MASK)
    return out


def secrets_of(url: str) -> list[str]:
    """The credential values ``url`` carries (userinfo password, secret query values)."""
    from urllib.parse import unquote

    head, _, query = url.partition("?")
    found = []
    netloc = head.partition("://")[2].partition("/")[0]
    userinfo = netloc.rpartition("@")[0]
    if ":" in userinfo:
        found.append(userinfo.split(":", 1)[1])
    for item in query.partition("#")[0].split("&"):
        name, eq, value = item.partition("=")
        if eq and value and is_secret_name(name):
            found.append(value)
    found += [unquote(s) for s in found]
    return sorted({s for s in found if s}, key=len, reverse=True)
