"""User input quoted back in a message (a denial, an error, a log line) at a bounded length.

A pod can carry a 256 KiB annotation; echoed whole, one bad value would fill the denial the user reads, the API
server's audit log and the webhook's log line. Every message that quotes what a user wrote goes through :func:`echo`.
"""

from __future__ import annotations

import json

ECHO_CHARS = 80  # the head of a long value that is shown: enough to recognise it


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """``value`` as a message quotes it: a string as ``repr`` writes it, anything else as JSON, cut to ``limit``
    characters with its full size in bytes after it (``'xxxx…' (200000 bytes)``)."""
    if isinstance(value, str):
        text, quote = value, True
    else:
        text, quote = json.dumps(value, default=str, ensure_ascii=False), False
    if len(text) <= limit:
        return repr(text) if quote else text
    head = repr(text[:limit]) if quote else text[:limit]
    return f"{head}… ({len(text.encode('utf-8', 'replace'))} bytes)"
