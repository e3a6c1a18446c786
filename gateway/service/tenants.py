"""Tenants and their API keys: who is calling, what they may use, and the namespace their ids live in.

Keys come from config as SHA-256 digests (``auth.tenants[].key_sha256``) or from environment
variables named in config (``key_env``), hashed once at start-up; a clear key is never kept,
logged or echoed. A request presents its key as ``Authorization: Bearer <key>`` (OpenAI clients)
or ``x-api-key: <key>`` (Anthropic clients); the key is hashed and the digest looked up, then
found by a dict lookup of the digest (timing can only leak bits of a SHA-256 of the key, which
say nothing usable about it); the few admin digests are compared with :func:`hmac.compare_digest`.

Isolation: every id a tenant sends (session ids, response ids, hint targets) is stored as
``tenant.namespace(id)`` = ``"<tenant>:<id>"``, so a key can never address another tenant's state,
even by guessing ids; each tenant's ``cache_salt`` (vLLM's per-request salt of the first block
hash) keeps tenants from sharing prefix-cache blocks, which closes the cross-tenant timing side
channel. The gateway must overwrite any client-supplied ``cache_salt`` with the tenant's.

With no key configured at all the registry is *open*: every request is the anonymous tenant (ids
not namespaced, no salt, no limits) and admin routes are open too. Config allows that only on a
loopback address unless ``auth.allow_unauthenticated`` is set; start-up logs it either way.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.config import AuthConfig, ConfigError, TenantConfig
from gateway.errors import NotAuthenticated, NotPermitted

log = logging.getLogger("agentgw.tenants")

MAX_KEY_BYTES = 4096
CREDENTIAL_HEADERS = frozenset({b"authorization", b"x-api-key"})
"""Headers carrying the caller's key: never forwarded to an engine."""
Headers = Iterable[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class Tenant:
    """A caller's identity and limits (immutable; the live counters live in admission)."""

    name: str
    models: frozenset[str] | None = None
    requests_per_s: float | None = None
    tokens_per_s: float | None = None
    burst_s: float = 2.0
    max_concurrent: int | None = None
    share: float = 1.0
    cache_salt: str | None = None
    admin: bool = False
    anonymous: bool = False

    def namespace(self, local_id: str) -> str:
        """The id under which this tenant's ``local_id`` is stored (identity for the anonymous
        tenant and for admins, who address stored ids directly)."""
        if self.anonymous or self.admin:
            return local_id
        return f"{self.name}:{local_id}"

    def local_id(self, stored_id: str) -> str | None:
        """Inverse of :meth:`namespace`; None when ``stored_id`` is not this tenant's."""
        if self.anonymous or self.admin:
            return stored_id
        prefix = f"{self.name}:"
        return stored_id[len(prefix) :] if stored_id.startswith(prefix) else None

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def check_model(self, model: str) -> None:
        """Raise a 403 naming ``model`` when this tenant may not use it."""
        if not self.allows_model(model):
            raise NotPermitted(f"this API key may not use model '{model}'", "model_not_allowed", "model")


ANONYMOUS = Tenant(name="anonymous", anonymous=True)
ADMIN = Tenant(name="admin", admin=True)


def key_digest(key: str | bytes) -> str:
    """Hex SHA-256 of a key, as ``key_sha256`` holds it."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def cache_salt(tenant: str, secret: str) -> str:
    """A tenant's stable prefix-cache salt (same on every replica with the same secret)."""
    return hashlib.sha256(f"agentgw-cache-salt\0{secret}\0{tenant}".encode()).hexdigest()[:32]


def presented_keys(headers: Headers) -> list[bytes]:
    """The keys a request presents: ``Authorization: Bearer``'s first, then ``x-api-key``'s."""
    bearer: list[bytes] = []
    api_key: list[bytes] = []
    for name, value in headers:
        n = name.lower()
        if n == b"authorization":
            scheme, _, rest = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and rest.strip():
                bearer.append(rest.strip())
        elif n == b"x-api-key" and value.strip():
            api_key.append(value.strip())
    return bearer + api_key


class TenantRegistry:
    """Maps a request's key to its :class:`Tenant`; knows the admin keys."""

    def __init__(self, tenants: Mapping[str, Tenant], admin_digests: Iterable[str]) -> None:
        self._by_digest = dict(tenants)
        self._admin = frozenset(admin_digests)
        self.open = not self._by_digest and not self._admin
        self.tenants = {t.name: t for t in self._by_digest.values()}

    @classmethod
    def from_config(
        cls,
        auth: AuthConfig,
        listen_host: str = "127.0.0.1",
        environ: Mapping[str, str] | None = None,
        announce: bool = True,
    ) -> TenantRegistry:
        """Build from ``auth``; keys named by ``*_env`` are read from ``environ`` (default
        ``os.environ``) and hashed. Logs the mode when ``announce`` (never a key). Raises
        ConfigError for an environment variable that is unset or empty."""
        env = os.environ if environ is None else environ
        secret = (
            _env(env, auth.cache_salt_secret_env, "auth.cache_salt_secret_env")
            if auth.cache_salt_secret_env
            else ""
        )
        by_digest: dict[str, Tenant] = {}
        for i, tc in enumerate(auth.tenants):
            tenant = _tenant(tc, secret)
            digests = list(tc.key_sha256)
            digests += [key_digest(_env(env, v, f"auth.tenants.{i}.key_env")) for v in tc.key_env]
            for d in digests:
                if d in by_digest and by_digest[d].name != tenant.name:
                    raise ConfigError(
                        f"auth.tenants.{i}: a key of '{tc.name}' is also a key of '{by_digest[d].name}'"
                    )
                by_digest[d] = tenant
        admin = list(auth.admin_key_sha256)
        admin += [key_digest(_env(env, v, "auth.admin_key_env")) for v in auth.admin_key_env]
        clash = set(admin) & by_digest.keys()
        if clash:
            raise ConfigError("auth: an admin key is also a tenant key")
        reg = cls(by_digest, admin)
        if not announce:
            return reg
        if reg.open:
            log.warning(
                "auth: running WITHOUT API keys on %s: every caller is the anonymous tenant and "
                "admin routes are open (configure auth.tenants and auth.admin_key_sha256 to require keys)",
                listen_host,
            )
        else:
            log.warning(
                "auth: API keys required: %d tenant(s) with %d key(s), %d admin key(s)",
                len(reg.tenants),
                len(by_digest),
                len(reg._admin),
            )
        return reg

    def _lookup(self, key: bytes) -> Tenant | None:
        if len(key) > MAX_KEY_BYTES:
            return None
        d = key_digest(key)
        if any(hmac.compare_digest(d, a) for a in self._admin):  # few admin keys: constant time
            return ADMIN
        return self._by_digest.get(d)

    def authenticate(self, headers: Headers) -> Tenant:
        """The caller's tenant (:data:`ADMIN` for an admin key, :data:`ANONYMOUS` when open).
        Raises :class:`NotAuthenticated` for a missing or unknown key."""
        if self.open:
            return ANONYMOUS
        keys = presented_keys(headers)
        if not keys:
            raise NotAuthenticated(
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'", "missing_api_key"
            )
        for key in keys:
            tenant = self._lookup(key)
            if tenant is not None:
                return tenant
        raise NotAuthenticated("invalid API key", "invalid_api_key")

    def is_admin(self, headers: Headers) -> bool:
        if self.open:
            return True
        return any(self._lookup(k) is ADMIN for k in presented_keys(headers))

    def require_admin(self, headers: Headers) -> None:
        """Raise :class:`NotAuthenticated` (no or unknown key) or :class:`NotPermitted` (a
        tenant's key) unless the caller is an admin (anyone is, when the registry is open)."""
        if self.open or self.authenticate(headers).admin:
            return
        raise NotPermitted("this route needs an admin key", "admin_required")


def _tenant(tc: TenantConfig, secret: str) -> Tenant:
    return Tenant(
        name=tc.name,
        models=frozenset(tc.models) if tc.models is not None else None,
        requests_per_s=tc.requests_per_s,
        tokens_per_s=tc.tokens_per_s,
        burst_s=tc.burst_s,
        max_concurrent=tc.max_concurrent,
        share=tc.share,
        cache_salt=cache_salt(tc.name, secret),
    )


def _env(env: Mapping[str, str], name: str, key: str) -> str:
    value = env.get(name, "")
    if not value:
        raise ConfigError(f"invalid config key '{key}': environment variable {name} is not set")
    return value
