"""The object tier against a real S3 server (SeaweedFS): uploads, listings, fetches into an
empty local directory, a corrupt object, a store that is down or hangs. No engine: the
engine test is in test_engine_objects.py."""

import os
import time
import uuid

import numpy as np
import pytest
from synth import BLOCK, FP, byte_table, make, planner, prompt, prompt_of, save

from vllm_kvdisk.core.objects import ObjectUrl, prefix_names
from vllm_kvdisk.storage.objectstore import Bucket
from vllm_kvdisk.storage.objecttier import ObjectTier
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify


@pytest.fixture
def aws(seaweed, monkeypatch):
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    return seaweed


class Counts:
    """A stats recorder's two calls, into one dict."""

    def __init__(self, tier):
        self.seen = {}
        tier.report_to(self)

    def add(self, name, n):
        self.seen[name] = self.seen.get(name, 0) + n

    def count(self, name, label, n):
        self.add(label, n)


def counts(tier):
    return Counts(tier).seen


def tier_of(store, url, timeout_s=5.0, deadline_s=20.0, retry_after_s=(0.05,)):
    return ObjectTier(
        store, Bucket(url, timeout_s=timeout_s), deadline_s=deadline_s, retry_after_s=retry_after_s
    )


def url_of(seaweed):
    return ObjectUrl.parse(f"s3://{seaweed.bucket}/t-{uuid.uuid4().hex[:8]}")


def two_files(tmp_path, tier=None):
    """Store A with a root at 48 tokens and its child at 112 of one prompt."""
    store, ns = make(tmp_path / "a")
    p = prompt(7)
    rng = np.random.default_rng(1)
    root, _ = save(store, ns, p, 48, rng)
    child, _ = save(store, ns, p, 112, rng)
    assert child.parent == root.sha1
    return store, ns, p, root, child


def fetch_into(store, tier, ns, p, usable=150, local_hit=0):
    names = lambda: prefix_names(byte_table(), p.ids, BLOCK, usable)  # noqa: E731
    job = tier.fetch(ns, names, local_hit, lambda s: store.index.get(ns, s) is not None)
    if job is not None:
        assert job.done.wait(30)
    return job


def test_upload_then_fetch_into_an_empty_directory(aws, tmp_path):
    url = url_of(aws)
    a, ns, p, root, child = two_files(tmp_path)
    tier_a = tier_of(a, url)
    client = aws.client()
    client.put_object(Bucket=aws.bucket, Key=f"{url.prefix}/{ns}/notes.txt", Body=b"not ours")
    for plan in (root, child):
        tier_a.saved(ns, plan.sha1)
    assert tier_a.drain(30)
    assert counts(tier_a)["uploaded"] == 2
    keys = {
        o["Key"] for o in client.list_objects_v2(Bucket=aws.bucket, Prefix=url.prefix)["Contents"]
    }
    assert {url.key(ns, root.sha1), url.key(ns, child.sha1)} <= keys
    assert tier_a.bucket.list_names(ns) == {root.sha1, child.sha1}  # the other key ignored
    tier_a.saved(ns, child.sha1)  # again: the object is never replaced
    assert tier_a.drain(30)
    assert counts(tier_a)["upload_exists"] == 1

    b = Store(str(tmp_path / "b" / "cache"), space_bytes=1 << 30)
    b.ensure_namespace(FP)
    tier_b = tier_of(b, url)
    assert planner(b).lookup(ns, p.ids, 150).tokens == 0
    job = fetch_into(b, tier_b, ns, p)
    assert job is not None and not job.reason
    assert sorted(job.installed) == sorted([root.sha1, child.sha1])
    assert planner(b).lookup(ns, p.ids, 150).tokens == 112
    for plan in (root, child):
        with open(a.path(ns, plan.sha1), "rb") as fa, open(b.path(ns, plan.sha1), "rb") as fb:
            assert fa.read()[48:] == fb.read()[48:]  # the header's hit count may differ
    assert verify(b).ok
    assert fetch_into(b, tier_b, ns, p) is None  # nothing deeper remotely: no fetch
    for t in (tier_a, tier_b):
        t.close()


def test_corrupt_object_is_quarantined_deleted_and_never_fetched_again(aws, tmp_path):
    url = url_of(aws)
    a, ns, p, root, child = two_files(tmp_path)
    client = aws.client()
    for plan in (root, child):
        with open(a.path(ns, plan.sha1), "rb") as fh:
            data = bytearray(fh.read())
        if plan is child:
            data[-100] ^= 0xFF  # a page byte: only the layer checksum can tell
        client.put_object(Bucket=aws.bucket, Key=url.key(ns, plan.sha1), Body=bytes(data))
    b = Store(str(tmp_path / "b" / "cache"), space_bytes=1 << 30)
    b.ensure_namespace(FP)
    tier_b = tier_of(b, url)
    job = fetch_into(b, tier_b, ns, p)
    assert job.installed == [root.sha1]
    assert "corrupt" in job.reason
    assert counts(tier_b)["corrupt"] == 1
    assert len(b.quarantined_files()) == 1
    assert planner(b).lookup(ns, p.ids, 150).tokens == 48  # the sound root serves
    assert tier_b.bucket.list_names(ns) == {root.sha1}  # deleted from the bucket
    assert fetch_into(b, tier_b, ns, p) is None
    assert verify(b).ok
    tier_b.close()


def test_store_down_is_a_miss_within_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    a, ns, p, root, child = two_files(tmp_path)
    tier = tier_of(a, ObjectUrl.parse("s3://kvdisk-test/x"), timeout_s=1.0, deadline_s=5.0)
    tier.saved(ns, child.sha1)
    assert tier.drain(30)
    assert counts(tier) == {"upload_retried": 1, "upload_failed": 1}  # tried twice
    started = time.monotonic()
    job = fetch_into(a, tier, ns, p, local_hit=0)
    assert job is not None and job.installed == []
    assert job.reason.startswith("object store:")
    assert time.monotonic() - started < 5.0
    tier.close()


def test_store_hanging_is_a_miss_at_the_deadline(aws, tmp_path):
    url = url_of(aws)
    a, ns, p, root, child = two_files(tmp_path)
    b = Store(str(tmp_path / "b" / "cache"), space_bytes=1 << 30)
    b.ensure_namespace(FP)
    tier_b = tier_of(b, url, timeout_s=30.0, deadline_s=2.0)
    names = lambda: prefix_names(byte_table(), p.ids, BLOCK, 150)  # noqa: E731
    aws.pause()
    try:
        started = time.monotonic()
        job = tier_b.fetch(ns, names, 0, lambda s: False)
        while not job.settled(time.monotonic()):
            time.sleep(0.05)
        waited = time.monotonic() - started
        assert 2.0 <= waited < 3.0
        assert job.reason.startswith("deadline")
    finally:
        aws.resume()
    assert os.path.isdir(b.root)
    tier_b.close()


def test_a_parent_inside_another_conversation_is_fetched_by_its_name(aws, tmp_path):
    """B's file is a delta on a file of A's conversation (they share 32 tokens): its name
    is not a prefix of B's prompt, the child's header names it, and the fetch follows."""
    url = url_of(aws)
    a, ns = make(tmp_path / "a")
    rng = np.random.default_rng(2)
    first = prompt(5)
    ids = first.ids.copy()
    ids[32:] = prompt(6).ids[32:]
    second = prompt_of(ids)
    root, _ = save(a, ns, first, 48, rng)
    child, _ = save(a, ns, second, 112, rng)
    assert child.parent == root.sha1 and child.parent_tokens == 32
    tier_a = tier_of(a, url)
    for plan in (root, child):
        tier_a.saved(ns, plan.sha1)
    assert tier_a.drain(30)
    b = Store(str(tmp_path / "b" / "cache"), space_bytes=1 << 30)
    b.ensure_namespace(FP)
    tier_b = tier_of(b, url)
    job = fetch_into(b, tier_b, ns, second)
    assert sorted(job.installed) == sorted([root.sha1, child.sha1]) and not job.reason
    assert planner(b).lookup(ns, second.ids, 150).tokens == 112
    assert verify(b).ok
    for t in (tier_a, tier_b):
        t.close()


def shard_files(store, fps, p, rng_seed=1):
    """The same root (48 tokens) and child (112) of prompt ``p`` in each shard's namespace
    (TP ranks: the same names, each rank its own pages)."""
    from synth import encode, pages

    from vllm_kvdisk.core.format import Reason

    out = []
    for fp in fps:
        ns = store.ensure_namespace(fp)
        rng = np.random.default_rng(rng_seed)
        plans = []
        for length in (48, 112):
            plan = planner(store).plan_save(ns, p, length, Reason.COLD)
            enc = encode(plan, p, pages(rng, plan), fp=fp)
            store.write(ns, plan.sha1, enc)
            plans.append(plan)
        out.append((ns, plans))
    return out


def test_tp_shards_are_fetched_together_and_a_name_waits_for_every_shard(aws, tmp_path):
    """With TP 2 each rank loads its own namespace's file of a name: a fetch brings every
    shard's file, and installs a name in rank 0's namespace (where lookups look) only once
    every shard has it, so no rank is left to fail its load."""
    from dataclasses import replace

    url = url_of(aws)
    fps = [replace(FP, tp_size=2, tp_rank=r) for r in (0, 1)]
    a = Store(str(tmp_path / "a" / "cache"), space_bytes=1 << 30)
    p = prompt(9)
    (ns0, (root, child)), (ns1, _) = shard_files(a, fps, p)
    tier_a = tier_of(a, url)
    for ns in (ns0, ns1):
        for plan in (root, child):
            tier_a.saved(ns, plan.sha1)
    assert tier_a.drain(30)

    def fetch(b):
        tier_b = tier_of(b, url)
        names = lambda: prefix_names(byte_table(), p.ids, BLOCK, 150)  # noqa: E731
        made = lambda: [b.ensure_namespace(fps[1])]  # noqa: E731 - rank 0's made by the caller
        b.ensure_namespace(fps[0])
        job = tier_b.fetch(ns0, names, 0, lambda s: b.index.get(ns0, s) is not None, made)
        assert job is not None and job.done.wait(30)
        tier_b.close()
        return job

    b = Store(str(tmp_path / "b" / "cache"), space_bytes=1 << 30)
    job = fetch(b)
    assert not job.reason and sorted(job.installed) == sorted([root.sha1, child.sha1])
    for ns in (ns0, ns1):
        for plan in (root, child):
            with open(a.path(ns, plan.sha1), "rb") as fa, open(b.path(ns, plan.sha1), "rb") as fb:
                assert fa.read()[48:] == fb.read()[48:]
    assert planner(b).lookup(ns0, p.ids, 150).tokens == 112
    assert verify(b).ok

    # Rank 1's child is gone from the bucket: rank 0's child is not installed (a hit on it
    # would fail rank 1's load), the root is, for both ranks.
    aws.client().delete_object(Bucket=aws.bucket, Key=url.key(ns1, child.sha1))
    c = Store(str(tmp_path / "c" / "cache"), space_bytes=1 << 30)
    job = fetch(c)
    assert job.installed == [root.sha1] and "another TP rank" in job.reason
    assert c.index.get(ns1, root.sha1) is not None and c.index.get(ns0, child.sha1) is None
    assert planner(c).lookup(ns0, p.ids, 150).tokens == 48
    for t in (tier_a,):
        t.close()


def test_a_failed_upload_is_tried_again_and_lands(aws, tmp_path, monkeypatch):
    """The store refuses the first attempt (a failure injected into the client call; the
    second goes to the real server): the object lands, counted once retried."""
    from vllm_kvdisk.storage.objectstore import ObjectStoreError

    url = url_of(aws)
    a, ns, p, root, child = two_files(tmp_path)
    tier = tier_of(a, url)
    real, calls = tier.bucket.put_file, []

    def flaky(*args):
        calls.append(args[:2])
        if len(calls) == 1:
            raise ObjectStoreError("503 Slow Down (injected)")
        return real(*args)

    monkeypatch.setattr(tier.bucket, "put_file", flaky)
    tier.saved(ns, root.sha1)
    assert tier.drain(30)
    assert counts(tier) == {"upload_retried": 1, "uploaded": 1}
    assert calls == [(ns, root.sha1)] * 2
    assert tier.bucket.list_names(ns) == {root.sha1}
    tier.close()
