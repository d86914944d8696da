"""Gateway keys (docs/tenancy.md#gateway-keys). The config holds only each key's SHA-256: keys are 256 random bits, so a
fast hash is the right one (nothing to guess from it). Pure code, no I/O."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.config.auth import AuthConfig, KeyConfig
from gateway.errors import Unauthorized

KEY_PREFIX = "tg-"


def new_key() -> str:
    """256 random bits, URL-safe base64: 46 characters with the prefix."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    """What the config keeps (``auth.keys[].sha256``)."""
    return hashlib.sha256(key.encode()).hexdigest()


def masked(token: str) -> str:
    """Its first six and last four characters, as OpenAI's messages show a key ("sk-abc***wxyz")."""
    return f"{token[:6]}***{token[-4:]}" if len(token) > 12 else "***"


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per configured key
class Key:
    """Its name and config, never the key itself."""

    name: str
    cfg: KeyConfig


class Keys:
    def __init__(self, auth: AuthConfig) -> None:
        self.by_hash = {k.sha256: Key(k.name, k) for k in auth.keys}
        self.scrape = frozenset(auth.metrics.sha256)
        self.public_metrics = auth.metrics.public

    def may_scrape(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """Raises Unauthorized unless ``auth.metrics.public``, or the token is a scrape token: a gateway key is not,
        since a tenant reads no other tenant's spend."""
        if self.public_metrics:
            return
        token = _token(headers)
        if not token:
            raise Unauthorized("missing", "/metrics needs a scrape token: 'Authorization: Bearer <token>' "
                                          "(auth.metrics; tiergate keys add NAME --metrics).")
        hashed = digest(token)
        if not any(hmac.compare_digest(hashed, allowed) for allowed in self.scrape):
            raise Unauthorized("unknown", f"{masked(token)} is not a scrape token for /metrics (auth.metrics).")

    def authenticate(self, headers: Iterable[tuple[bytes, bytes]]) -> Key:
        """``headers``: ASGI's, lower-case names. Raises Unauthorized (``reason`` ``missing``, ``malformed`` or
        ``unknown``), its message showing at most a masked key (OpenAI API reference, "Authentication")."""
        token = _token(headers)
        if not token:
            raise Unauthorized("missing", "You didn't provide an API key. Send your gateway key as 'Authorization: "
                                           "Bearer <key>' (the OpenAI SDKs do, from OPENAI_API_KEY).")
        hashed = digest(token)
        found = self.by_hash.get(hashed)
        if found is None or not hmac.compare_digest(found.cfg.sha256, hashed):
            raise Unauthorized("unknown", f"Incorrect API key provided: {masked(token)}.")
        return found


def _token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """``Authorization``'s bearer token, else ``api-key``'s value (Azure-style clients), or None. Raises Unauthorized
    (``malformed``) for an ``Authorization`` that is not ``Bearer <token>``."""
    token = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, rest = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not rest.strip():
                raise Unauthorized("malformed", "The Authorization header must be 'Bearer <gateway key>'.")
            token = rest.strip()
        elif name == b"api-key" and token is None:
            token = value.decode("latin-1").strip()
    return token
