"""Tenants stay apart through a real server: with the default tenancy setting each API key
is a tenant, and a tenant's prompts are never cached for another, on the device or on disk,
before or after a restart."""

import pytest
from engine import Server, disk_tokens
from helpers import kv_files, text

pytestmark = pytest.mark.engine
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_api_key_never_hits_another_keys_prompt(tiny_model, tmp_path):
    kv, log = str(tmp_path / "kv"), str(tmp_path / "log")
    keys = ("--api-key", "key-a", "key-b")
    messages = [
        {"role": "system", "content": text(0, 900)},
        {"role": "user", "content": "Summarise: " + text(900, 200)},
    ]
    server = Server(tiny_model, kv, log, *keys)
    try:
        assert cached(server.chat(messages, max_tokens=4, headers=A)) == 0
        # B guesses A's prompt exactly: nothing tells B that A sent it ...
        assert cached(server.chat(messages, max_tokens=4, headers=B)) == 0
        # ... while A's own next request hits, and a salt of B's choosing changes nothing.
        assert cached(server.chat(messages, max_tokens=4, headers=A)) > 1000
        assert cached(server.chat(messages, max_tokens=4, headers=B, cache_salt="x")) == 0
        assert server.stop()["rc"] == 0
        assert kv_files(kv)  # A's (and B's) checkpoints are on disk
        third = {"Authorization": "Bearer key-c"}
        server = Server(tiny_model, kv, log, "--api-key", "key-c", "key-a")
        before = disk_tokens(server)
        assert cached(server.chat(messages, max_tokens=4, headers=third)) == 0
        assert disk_tokens(server) == before
        assert cached(server.chat(messages, max_tokens=4, headers=A)) > 1000  # from disk
        assert disk_tokens(server) > before
    finally:
        server.stop()
