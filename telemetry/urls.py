"""The one place that turns a service URL into something safe to print.

Redis and PostgreSQL URLs may carry a secret in two places: the userinfo (``redis://user:secret@host``) and the
query (``redis://host?password=secret``, libpq's ``?password=`` / ``?sslpassword=``, redis-py's
``?ssl_keyfile_password=``). Every log line, error message and status field that shows a URL goes through
:func:`redact_url`.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
# Query parameters whose value is a secret: any name containing one of these words (case-insensitive). "key"
# covers webhooks' ``?api_key=`` / ``?apikey=`` (it also masks ``ssl_keyfile``, a path: harmless).
SECRET_WORDS = ("password", "passwd", "secret", "token", "key", "auth", "signature")
# ``scheme://user:password@``, the password read as SQLAlchemy's ``make_url`` reads it: everything up to the
# first ``@``, so that ``#``, ``?`` and ``/`` inside it (which ``urlsplit`` takes for the fragment, the query or the
# path) are masked too.
_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@?#]*:)(?P<password>[^@]*)@")


def _is_secret(name: str) -> bool:
    low = name.lower()
    return any(w in low for w in SECRET_WORDS)


def redact_url(url: str) -> str:
    """``url`` with the password of its userinfo and every secret query value replaced by ``***``.

    Args:
        url: a Redis or SQLAlchemy URL as the user gave it.

    Returns:
        The URL to show; ``<unparsable url>`` when it cannot be parsed (never the raw text, which may hold a
        secret in a place this parser did not recognise).
    """
    try:
        m = _USERINFO.match(url)
        if m is not None:
            url = f"{m['head']}{MASK}@{url[m.end():]}"
        parts = urlsplit(url)
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if not any(_is_secret(k) for k, _ in pairs):
            return url  # urlunsplit would drop the empty authority of sqlite:////abs/path
        query = urlencode([(k, MASK if _is_secret(k) else v) for k, v in pairs], safe="*")
        return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<unparsable url>"
