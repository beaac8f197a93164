"""Tenants on one cache directory: what a lookup, the CLI and the files on disk may say
about another tenant (cache salt), and what each tenant costs."""

from __future__ import annotations

import numpy as np
from synth import FP, planner, prompt, save

from vllm_kvdisk.core.index import Miss
from vllm_kvdisk.core.keys import Fingerprint
from vllm_kvdisk.storage.store import Store


def test_a_miss_never_names_another_salts_namespace(tmp_path):
    """Salt A's files hold the prompt's prefix; a lookup under salt B must read the same
    as a lookup of a prompt nobody stored (else /metrics confirms A's prompt to B). The
    same tenant's files of another model are still named: an operator's diagnostic."""
    store = Store(str(tmp_path / "kv"), space_bytes=1 << 30)
    salt_a, salt_b = "a" * 32, "b" * 32
    ns_a = store.ensure_namespace(FP.scoped("", salt_a))
    ns_b = store.ensure_namespace(FP.scoped("", salt_b))
    other_model = Fingerprint("other-model", "main", "float32", "x", 16, 1, 0, salt_digest=salt_a)
    ns_a2 = store.ensure_namespace(other_model)
    p = prompt(3)
    save(store, ns_a, p, 112, np.random.default_rng(0))
    look = planner(store).lookup
    got_b = look(ns_b, p.ids, 399, store.peers("", salt_b))
    unknown = look(ns_b, prompt(4).ids, 399, store.peers("", salt_b))
    assert got_b.miss is Miss.NO_CHECKPOINT and got_b.other_namespaces == ()
    assert (got_b.miss, got_b.other_namespaces) == (unknown.miss, unknown.other_namespaces)
    got_lora = look(ns_b, p.ids, 399, store.peers("adapter", salt_a))  # another scope
    assert got_lora.miss is Miss.NO_CHECKPOINT
    same_tenant = look(ns_a2, p.ids, 399, store.peers("", salt_a))
    assert same_tenant.miss is Miss.OTHER_NAMESPACE and same_tenant.other_namespaces == (ns_a,)
