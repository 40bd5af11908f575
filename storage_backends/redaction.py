"""URLs fit to show: logs, error messages, CLI tables and JSON never carry a credential.

``redact_url("redis://user:pw@host:6379/0?password=pw&db=0")`` gives
``"redis://user:***@host:6379/0?password=***&db=0"``: the password of the userinfo part and the
value of every query parameter whose name looks like a credential (password, passwd, pwd, token,
secret, auth, credential, api key, access key, signature) are replaced; the rest of the URL stays
as it was written (no re-encoding, ``unix:///`` keeps its slashes).

A password may hold ``/``, ``?``, ``#`` and ``@`` written unescaped, and a query value ``@``: where
a URL has several ``@`` (or a ``?`` before one) it can be read several ways, and what is secret in
any of those readings is hidden (the userinfo ending at each ``@`` after ``://``, or no userinfo).
A well-formed URL has one reading; an ambiguous one shows less than it could, never more. Which
URLs parsers (urllib's, redis-py's) read with another password than written:
:func:`password_misread`.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

MASK = "***"
SECRET_WORDS = ("pass", "pwd", "token", "secret", "auth", "credential", "apikey", "api_key", "api-key",
                "access_key", "accesskey", "signature", "sig")
PIECE = 3  # redact_text: pieces of a secret between delimiters this long or longer are hidden too
DELIMITERS = "/?#@:&="  # where parsers cut a secret written unescaped (and quote a piece of it)


def is_secret_name(name: str) -> bool:
    """Whether a query parameter named ``name`` holds a credential."""
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def redact_url(url: object) -> str:
    """``url`` with its userinfo password and credential-like query values as ``***``."""
    text = str(url)
    out, end = [], 0
    for start, stop in _merged(_secret_spans(text)):
        out += [text[end:start], MASK]
        end = stop
    return "".join(out) + text[end:]


def secrets_of(url: str) -> list[str]:
    """The credential values ``url`` carries (userinfo password, secret query values), in every
    reading of it, as written and decoded; the longest first."""
    found = [url[start:stop] for start, stop in _secret_spans(url)]
    found += [unquote(s) for s in found]
    return sorted({s for s in found if s}, key=len, reverse=True)


def redact_text(text: str, url: object) -> str:
    """``text`` with every secret of ``url`` (and ``url`` itself) replaced: for messages that
    may quote a URL they did not get through :func:`redact_url` (a child's stderr, a library's
    exception), pieces of a secret included (a parser that cut it at a ``/`` quotes one); of
    PIECE characters or more (a shorter string would be hidden everywhere in ``text``)."""
    raw = str(url)
    out = text.replace(raw, redact_url(raw))
    secrets = secrets_of(raw)
    pieces = {p for s in secrets for p in _split(s)}
    for secret in sorted({s for s in {*secrets, *pieces} if len(s) >= PIECE}, key=len, reverse=True):
        out = out.replace(secret, MASK)
    return out


def password_misread(url: object) -> bool:
    """Whether URL parsers (urllib's, redis-py's) take part of the password ``url`` carries for
    its host, port or path: it holds a ``/``, ``?`` or ``#`` unescaped (its userinfo read up to
    the last ``@``). A URL whose last ``@`` lies in the query after a host and port is taken as
    written: it is one a parser reads."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    userinfo = rest.rpartition("@")[0] if sep else ""
    user, colon, password = userinfo.partition(":")
    if not colon or any(c in user for c in "/?#"):
        return False
    try:
        parts = urlsplit(text)
        return parts.password != password and not ("@" in parts.query + parts.fragment and parts.port)
    except ValueError:  # a port that is no number (a piece of the password), a bad IPv6 host
        return True


def _secret_spans(text: str) -> list[tuple[int, int]]:
    """Where secrets lie in ``text`` (start, end), in each of its readings."""
    scheme, sep, rest = text.partition("://")
    base = len(scheme) + 3 if sep else 0
    spans, starts = [], [base]  # where the part after the userinfo starts, per reading
    for at in (i for i, c in enumerate(rest) if c == "@") if sep else ():
        user, colon, _ = rest[:at].partition(":")
        if colon and not any(c in user for c in "/?#"):
            spans.append((base + len(user) + 1, base + at))
        starts.append(base + at + 1)
    for start in starts:
        spans += _query_secrets(text, start)
    return [(a, b) for a, b in spans if b > a]


def _query_secrets(text: str, start: int) -> list[tuple[int, int]]:
    """The spans of the secret values in the query of ``text[start:]`` (after its first ``?``)."""
    begin = text.find("?", start)
    if begin < 0:
        return []
    end = text.find("#", begin)
    end = len(text) if end < 0 else end
    spans, at = [], begin + 1
    for item in text[begin + 1 : end].split("&"):
        name, eq, value = item.partition("=")
        if eq and is_secret_name(name):
            spans.append((at + len(name) + 1, at + len(item)))
        at += len(item) + 1
    return spans


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _split(secret: str) -> list[str]:
    for delimiter in DELIMITERS:
        secret = secret.replace(delimiter, "\0")
    return secret.split("\0")
