"""The tenancy gate: which tenant a request belongs to, the salt it gets, and the ASGI
middleware that sets it on the request body before vLLM reads it."""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm_kvdisk.api.tenancy import STATE_KEY, TenancyGate, TenancyMiddleware
from vllm_kvdisk.core.config import ConfigError, load_config
from vllm_kvdisk.core.tenancy import (
    DERIVED_PREFIX,
    TenancyRefused,
    effective_salt,
    tenant_of,
)


def test_the_tenant_comes_from_the_bearer_key_or_the_named_header():
    headers = {"authorization": "Bearer sk-a", "x-tenant-id": "team-7"}
    assert tenant_of(headers, "api_key", "x-tenant-id") == "sk-a"
    assert tenant_of(headers, "header", "X-Tenant-Id") == "team-7"
    assert tenant_of(headers, "none", "x-tenant-id") is None
    assert tenant_of({"authorization": "Basic abc"}, "api_key", "") is None
    assert tenant_of({"authorization": "Bearer "}, "api_key", "") is None
    assert tenant_of({}, "header", "x-tenant-id") is None


def test_tenants_never_share_a_salt_and_no_client_salt_reaches_another_tenants():
    a = effective_salt("sk-a", None, required=False)
    b = effective_salt("sk-b", None, required=False)
    assert a != b and a.startswith(DERIVED_PREFIX)
    assert effective_salt("sk-a", None, required=False) == a  # stable across restarts
    # A tenant may split its own traffic, never land in another tenant's partition:
    assert effective_salt("sk-b", a, required=False) not in (a, b)
    assert effective_salt("sk-a", "s1", required=False) != a
    # A client without a tenant that imitates a derived salt is moved aside ...
    imitated = effective_salt(None, a, required=False)
    assert imitated != a and not imitated.startswith(DERIVED_PREFIX)
    # ... and every other salt is its own, as before.
    assert effective_salt(None, "mine", required=False) == "mine"
    assert effective_salt(None, None, required=False) is None
    for salt in (a, imitated):  # what vLLM accepts as a cache_salt
        assert len(salt) <= 128 and not set(salt) & set("@/\\\0")


def test_a_request_naming_no_tenant_is_refused_when_one_is_required():
    with pytest.raises(TenancyRefused):
        effective_salt(None, None, required=True)
    assert effective_salt(None, "s", required=True) == "s"


def test_the_settings_are_checked_at_start():
    cfg = load_config({"kv_disk_dir": "/tmp/x"})
    assert (cfg.kv_tenant_from, cfg.kv_tenant_required) == ("api_key", False)
    with pytest.raises(ConfigError, match="kv_tenant_from"):
        load_config({"kv_disk_dir": "/tmp/x", "kv_tenant_from": "cookie"})


# -- the middleware, driven as an ASGI server drives it ---------------------------------
class Seen:
    """The app behind the gate: records the body and state it was given."""

    def __init__(self):
        self.body = None
        self.state = None

    async def __call__(self, scope, receive, send):
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.body, self.state = b"".join(chunks), scope.get("state", {})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(gate, path, body: bytes, headers=(), chunks=1):
    seen = Seen()
    app = TenancyMiddleware(seen, gate)
    size = max(1, -(-len(body) // chunks))
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
        for i, p in enumerate(parts)
    ]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in headers],
    }
    asyncio.run(app(scope, receive, send))
    return seen, sent[0]["status"]


def gate(source="api_key", required=False):
    g = TenancyGate()
    g.configure(source, "x-tenant-id", required)
    return g


def test_the_gate_sets_the_tenants_salt_on_a_chat_body_read_in_pieces():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]})
    seen, status = call(
        gate(), "/v1/chat/completions", body.encode(), [("authorization", "Bearer sk-a")], 7
    )
    assert status == 200
    sent = json.loads(seen.body)
    assert sent["cache_salt"] == effective_salt("sk-a", None, required=False)
    assert sent["messages"] == json.loads(body)["messages"]
    assert seen.state[STATE_KEY] == sent["cache_salt"]


def test_the_gate_leaves_other_routes_foreign_bodies_and_tenantless_requests_alone():
    body = b'{"model": "m", "prompt": "hi"}'
    assert call(gate(), "/v1/completions", body)[0].body == body  # no tenant, no salt
    assert (
        call(gate(), "/v1/load_lora_adapter", body, [("authorization", "Bearer k")])[0].body == body
    )
    assert (
        call(gate(), "/v1/completions", b"[1, 2", [("authorization", "Bearer k")])[0].body
        == b"[1, 2"
    )
    unconfigured = TenancyGate()
    assert (
        call(unconfigured, "/v1/completions", body, [("authorization", "Bearer k")])[0].body == body
    )
    # /tokenize has no cache_salt field: the salt goes to the request's state only
    seen, _ = call(gate(), "/tokenize", body, [("authorization", "Bearer k")])
    assert seen.body == body and seen.state[STATE_KEY] == effective_salt("k", None, required=False)


def test_a_required_tenant_is_refused_before_vllm_sees_the_request():
    seen, status = call(gate("none", required=True), "/v1/chat/completions", b'{"messages": []}')
    assert status == 400 and seen.body is None
    seen, status = call(gate("none", required=True), "/v1/chat/completions", b'{"cache_salt": "s"}')
    assert status == 200 and json.loads(seen.body)["cache_salt"] == "s"
