"""``stats``: what a running store's Prometheus exporter (``metrics_port``) says, summarised —
the metrics text fetched from its URL (credentials in the URL become a basic-auth header, never
output, and never sent on to another host a redirect names) or read from a saved scrape, and per
tier the hits, misses by reason, traffic and evictions; store-wide the events and queued bytes."""

from __future__ import annotations

import base64
import http.client
import urllib.error
import urllib.request
from collections import defaultdict
from math import isfinite
from pathlib import Path
from urllib.parse import unquote, urlsplit

from prometheus_client.parser import text_string_to_metric_families

from storage_backends.redaction import redact_text, redact_url
from tiered_kv.errors import BackendUnavailable, ConfigError, CredentialsRefused


def fetch(target: str, timeout: float = 5.0) -> str:
    """Metrics text from an exporter URL (``host:port`` is enough) or a saved file."""
    if Path(target).is_file():
        return _text(Path(target).read_bytes(), redact_url(target))
    if Path(target).exists():
        raise ConfigError(f"{redact_url(target)} is not a file: give a saved scrape or http(s)://HOST:PORT[/metrics]")
    if "://" not in target and not _has_port(target):
        raise ConfigError(f"no such file: {redact_url(target)} (a running store: http(s)://HOST:PORT[/metrics])")
    url = target if "://" in target else f"http://{target}"
    if url.split("://", 1)[1].count("/") == 0:
        url += "/metrics"
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"metrics URL must be http(s)://HOST:PORT[/metrics] or a file, got {redact_url(target)!r}")
    try:
        urlsplit(url).port  # noqa: B018 (a port out of range raises ValueError: a bad URL, not one down)
        with _OPENER.open(_request(url), timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):  # configuration, not "try again later" (exit 2, not 3)
            raise _refused(url, exc.code, exc.reason) from None
        raise BackendUnavailable(f"cannot fetch metrics from {redact_url(url)}: HTTP {exc.code} "
                                 f"{redact_text(str(exc.reason), url)}") from None
    except (urllib.error.URLError, OSError) as exc:  # (a connection closed unanswered is one)
        reason = redact_text(str(getattr(exc, "reason", exc)), url)
        raise BackendUnavailable(f"cannot fetch metrics from {redact_url(url)}: {reason}") from None
    except (http.client.InvalidURL, ValueError) as exc:  # a port that is no number, a bad IPv6 host
        raise ConfigError(f"bad metrics URL {redact_url(url)}: {redact_text(str(exc), url)}") from None
    except http.client.BadStatusLine as exc:  # it answered, but not in HTTP (an SSH or SMTP port)
        raise ConfigError(f"{redact_url(url)} does not answer HTTP (is it a tiered-kv exporter?): "
                          f"{redact_text(str(exc), url)[:80]!r}") from None
    except http.client.HTTPException as exc:  # an answer cut short, a header too long
        raise BackendUnavailable(f"cannot fetch metrics from {redact_url(url)}: {type(exc).__name__}: "
                                 f"{redact_text(str(exc), url)[:200]}") from None
    return _text(body, redact_url(url))


def _refused(url: str, code: int, reason: object) -> CredentialsRefused:
    """An endpoint that answered 401 (who are you?) or 403 (not you): the credentials of ``url``
    are missing or wrong, which no retry mends."""
    given = "@" in urlsplit(url).netloc
    fix = ("check the user and password in the URL" if given else
           "give a user and password in the URL: http(s)://USER:PASSWORD@HOST:PORT/metrics")
    return CredentialsRefused(f"authentication failed for the metrics endpoint {redact_url(url)}: HTTP {code} "
                              f"{redact_text(str(reason), url)}; {fix}")


class _SameHostAuth(urllib.request.HTTPRedirectHandler):
    """Follows redirects, but a basic-auth header goes only to the scheme, host and port it was
    given for (urllib sent it on to any host a redirect named)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(new.full_url) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


def _origin(url: str) -> tuple:
    parts = urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port


_OPENER = urllib.request.build_opener(_SameHostAuth)


def _has_port(target: str) -> bool:
    """Whether a target without a scheme names ``HOST:PORT`` (an exporter) rather than a path."""
    host = target.split("/", 1)[0].rpartition("@")[2]
    return host.rpartition(":")[2].isdigit()


def _text(body: bytes, source: str) -> str:
    try:
        return body.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not Prometheus metrics text (not UTF-8: {exc.reason} at byte {exc.start})") from None


def _request(url: str) -> urllib.request.Request:
    """A request for ``url``; ``user:password@`` in it becomes a basic-auth header (urllib would
    take it for a host name)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return urllib.request.Request(url)
    host = parts.netloc.rpartition("@")[2]
    token = base64.b64encode(f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode())
    return urllib.request.Request(parts._replace(netloc=host).geturl(),
                                  headers={"Authorization": "Basic " + token.decode()})


_TRAFFIC = ("tiered_kv_blocks_total", "tiered_kv_bytes_total", "tiered_kv_transfer_seconds_total")
_TIER_GAUGES = ("tiered_kv_tier_entries", "tiered_kv_tier_used_bytes", "tiered_kv_tier_capacity_bytes")
# the labels each summed metric needs; a sample without one (another exporter's, an older
# version's) is skipped and counted, as is one whose value is no finite number
_NEEDS = {"tiered_kv_hits_total": ("tier",), "tiered_kv_misses_total": ("tier", "reason"),
          "tiered_kv_evictions_total": ("tier",), "tiered_kv_events_total": ("event",),
          "tiered_kv_queued_bytes": ("direction",),
          **{n: ("tier", "direction") for n in _TRAFFIC}, **{n: ("tier",) for n in _TIER_GAUGES}}


def _usable(name: str, labels: dict, value: float) -> bool:
    if name in _TRAFFIC and labels.get("direction") not in ("in", "out"):
        return False
    return all(labels.get(label) for label in _NEEDS.get(name, ())) and (name not in _NEEDS or isfinite(value))


def summarize(text: str) -> dict:
    """Per tier: hits, misses by reason, blocks / bytes / seconds per direction, evictions,
    entries; store-wide: events and queued bytes (summed over namespaces); ``skipped_samples``:
    the samples left out (a label missing, a value no finite number)."""
    tiers: dict[str, dict] = defaultdict(lambda: {"hits": 0, "misses": defaultdict(float), "in": defaultdict(float),
                                                  "out": defaultdict(float), "evictions": 0})
    events: dict[str, float] = defaultdict(float)
    queued: dict[str, float] = defaultdict(float)
    namespaces = set()
    seen, skipped = False, 0
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError):  # (its message quotes the line: a .env file given by mistake)
        raise ConfigError("not Prometheus metrics text (a line of it is no metric sample)") from None
    for family in families:
        for s in family.samples:
            if not s.name.startswith("tiered_kv_") or s.name.endswith("_created"):
                continue
            lab = s.labels
            if not _usable(s.name, lab, s.value):
                skipped += 1
                continue
            seen = True
            namespaces.add((lab.get("namespace"), lab.get("model")))
            name, tier = s.name, lab.get("tier")
            if name == "tiered_kv_hits_total":
                tiers[tier]["hits"] += s.value
            elif name == "tiered_kv_misses_total":
                tiers[tier]["misses"][lab["reason"]] += s.value
            elif name in _TRAFFIC:
                what = name[len("tiered_kv_"):-len("_total")].replace("transfer_", "")
                tiers[tier][lab["direction"]][what] += s.value
            elif name == "tiered_kv_evictions_total":
                tiers[tier]["evictions"] += s.value
            elif name in _TIER_GAUGES:
                key = name[len("tiered_kv_tier_"):]
                tiers[tier][key] = tiers[tier].get(key, 0) + s.value
            elif name == "tiered_kv_events_total":
                events[lab["event"]] += s.value
            elif name == "tiered_kv_queued_bytes":
                queued[lab["direction"]] += s.value
    if not seen:
        left = f"; {skipped} samples skipped (a label missing or a value not a number)" if skipped else ""
        raise ConfigError(f"no tiered_kv metrics in that text (is it a tiered-kv exporter?){left}")
    out = {}
    for name, t in sorted(tiers.items()):
        row = {"hits": int(t["hits"]), "misses": {r: int(n) for r, n in sorted(t["misses"].items())},
               "evictions": int(t["evictions"])}
        total = row["hits"] + sum(row["misses"].values())
        row["hit_rate"] = round(row["hits"] / total, 4) if total else None
        for direction in ("in", "out"):
            d = t[direction]
            secs = d.get("seconds", 0.0)
            row[direction] = {"blocks": int(d.get("blocks", 0)), "bytes": int(d.get("bytes", 0)),
                              "seconds": round(secs, 6),
                              "mb_per_s": round(d.get("bytes", 0) / secs / 1e6, 1) if secs else None}
        for key in ("entries", "used_bytes", "capacity_bytes"):
            if key in t:
                row[key] = int(t[key])
        out[name] = row
    return {"namespaces": [{"namespace": n, "model": m} for n, m in sorted(namespaces, key=str)],
            "tiers": out, "events": {k: int(v) for k, v in sorted(events.items())},
            "queued_bytes": {k: int(v) for k, v in sorted(queued.items())}, "skipped_samples": skipped}
