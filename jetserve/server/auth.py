"""API keys: where a request may carry one, the same for HTTP headers and gRPC metadata.

Accepted: `Authorization: Bearer KEY` (the scheme in any case, as RFC 9110 has it) and
`x-api-key: KEY`. Keys are compared with hmac.compare_digest, so how long a comparison
takes says nothing about how much of a guess was right.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

HOW_TO_SEND = "send 'Authorization: Bearer KEY' or 'x-api-key: KEY'"


class ApiKey:
    """The key a server requires."""

    def __init__(self, key: str):
        self._key = key.encode()

    def accepts(self, headers: Iterable[tuple[str, str | bytes]]) -> bool:
        """True when some header (name, value) carries the key.

        Every candidate is compared, none skipped once one matches.
        """
        ok = False
        for name, value in headers:
            if isinstance(value, bytes):  # gRPC binary (-bin) metadata carries no key
                continue
            name = name.lower()
            if name == "authorization":
                scheme, _, value = value.strip().partition(" ")
                if scheme.lower() != "bearer":
                    continue
            elif name != "x-api-key":
                continue
            ok |= hmac.compare_digest(value.strip().encode(), self._key)
        return ok


def read_api_key_file(path: str) -> str:
    """The key in a file (its content, stripped): `--api-key-file`, which `ps` cannot show."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"--api-key-file {path!r}: cannot read it: {reason}") from None
    if not key:
        raise ValueError(f"--api-key-file {path!r} is empty")
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"--api-key-file {path!r}: the key must be one line of printable "
                         "ASCII (headers and gRPC metadata carry nothing else)")
    return key
