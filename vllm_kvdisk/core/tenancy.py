"""Which tenant a request belongs to, and the cache salt that keeps tenants apart.

vLLM partitions its device prefix cache by ``cache_salt`` and kvdisk derives its namespaces
from it, so a salt is a tenant boundary, but only if every client remembers to send one.
The tenancy setting (``kv_tenant_from``) takes the tenant from the request instead: its API
key (``Authorization: Bearer``) or a header a gateway sets. The salt vLLM then sees is a
digest of the tenant and of the client's own salt, so a client can partition its own
traffic further but can never name another tenant's partition: that would need the other
tenant's key. Requests without a tenant keep their own salt, except one that imitates a
derived salt, which is rewritten. Pure: the standard library only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

DERIVED_PREFIX = "kvt-"  # salts this module derives for a tenant
ESCAPED_PREFIX = "kvc-"  # a tenant-less client's salt that imitated a derived one


class TenancyRefused(ValueError):
    """A request without a tenant (and without a salt) where the setting requires one."""


def tenant_of(headers: Mapping[str, str], source: str, header: str) -> str | None:
    """The tenant named by a request's headers (names in lower case), or None."""
    if source == "api_key":
        scheme, _, key = headers.get("authorization", "").partition(" ")
        key = key.strip()
        return key if scheme.lower() == "bearer" and key else None
    if source == "header":
        value = headers.get(header.lower(), "").strip()
        return value or None
    return None


def _digest(tag: bytes, *parts: str) -> str:
    h = hashlib.sha256(tag)
    for part in parts:
        raw = part.encode("utf-8", "surrogatepass")
        h.update(len(raw).to_bytes(8, "little") + raw)
    return h.hexdigest()[:40]


def effective_salt(tenant: str | None, client_salt: str | None, *, required: bool) -> str | None:
    """The ``cache_salt`` vLLM and kvdisk see for this request."""
    if tenant is not None:
        return DERIVED_PREFIX + _digest(b"kvdisk-tenant\0", tenant, client_salt or "")
    if not client_salt:
        if required:
            raise TenancyRefused(
                "this server keeps prompt caches per tenant: send an API key, the tenant "
                "header or a cache_salt"
            )
        return None
    if client_salt.startswith(DERIVED_PREFIX):
        return ESCAPED_PREFIX + _digest(b"kvdisk-client\0", client_salt)
    return client_salt
