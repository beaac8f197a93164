"""The object tier against a real S3 server (SeaweedFS): uploads, listings, fetches into an
empty local directory, a corrupt object, a store that is down or hangs. No engine: the
engine test is in test_engine_objects.py."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from synth import BLOCK, FP, byte_table, encode, make, pages, planner, prompt, prompt_of, save
from tcpproxy import Proxy

from vllm_kvdisk.core.format import PageLayout, Reason
from vllm_kvdisk.core.keys import Fingerprint
from vllm_kvdisk.core.objects import ObjectUrl, prefix_names
from vllm_kvdisk.storage import fsdir
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


# A fetch that must succeed gets a deadline and request timeout far past any slowness of
# the store (a hang guard, never the verdict: a TP 2 replica on a 2-CPU CI machine once
# fetched 5 MB in over 10 s); the tests of deadlines pass their own short ones.
HANG_GUARD_S = 300.0


def tier_of(store, url, timeout_s=60.0, deadline_s=HANG_GUARD_S, retry_after_s=(0.05,)):
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


# -- kill -9 in the middle of a transfer -------------------------------------------------

CHILD = os.path.join(os.path.dirname(__file__), "object_child.py")
BIG = PageLayout("test:big", BLOCK, 2, (2, BLOCK, 512), "float32")  # 128 KiB per block
BIG_FP = Fingerprint("tiny", "main", "float32", BIG.name, BLOCK, 1, 0)
BIG_TOKENS = 1536  # a 12 MiB file: two ranged GETs


def big_file(root):
    """A store under ``root`` with one 12 MiB checkpoint: (store, ns, prompt, plan)."""
    store = Store(str(root / "cache"), space_bytes=1 << 30)
    ns = store.ensure_namespace(BIG_FP)
    p = prompt(3, n=BIG_TOKENS + 10)
    plan = planner(store).plan_save(ns, p, BIG_TOKENS, Reason.COLD)
    layers = pages(np.random.default_rng(3), plan, BIG)
    store.write(ns, plan.sha1, encode(plan, p, layers, fp=BIG_FP, layout=BIG))
    return store, ns, p, plan


def uploaded_big_file(root, url):
    """``big_file`` under ``root``, uploaded to ``url`` by a tier that is closed after."""
    a, ns, p, plan = big_file(root)
    tier_a = tier_of(a, url)
    tier_a.saved(ns, plan.sha1)
    assert tier_a.drain(60) and counts(tier_a) == {"uploaded": 1}
    tier_a.close()
    return a, ns, p, plan


def spawn(seaweed, endpoint, *args):
    """``object_child.py`` with the store at ``endpoint`` (a proxy in front of SeaweedFS)."""
    import vllm_kvdisk

    repo = os.path.dirname(os.path.dirname(os.path.abspath(vllm_kvdisk.__file__)))
    env = {**os.environ, **seaweed.env(), "AWS_ENDPOINT_URL": endpoint}
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, CHILD, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def killed(child):
    child.send_signal(signal.SIGKILL)
    out = child.communicate(timeout=30)[0].decode(errors="replace")
    assert child.returncode == -signal.SIGKILL, out  # killed in flight, not done
    return out


def wait_for(what, cond, child, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while not cond():
        if child.poll() is not None or time.monotonic() > end:
            out = child.communicate()[0].decode(errors="replace") if child.poll() else ""
            child.kill()
            pytest.fail(f"{what}: not seen (child exit {child.poll()}): {out}")
        time.sleep(0.05)


def bucket_keys(seaweed, url, ns):
    page = seaweed.client().list_objects_v2(Bucket=seaweed.bucket, Prefix=url.ns_prefix(ns))
    return {o["Key"] for o in page.get("Contents", ())}


def test_kill_during_an_upload_leaves_no_object_a_reader_would_use(aws, tmp_path):
    """The uploading process is killed (SIGKILL) after half of the file's bytes reached the
    server: the bucket holds no partial object under the name, a reader on an empty
    directory installs nothing, and the restarted uploader puts the whole file (a partial
    object there would have taken the name: If-None-Match would refuse it for good)."""
    url = url_of(aws)
    a, ns, p, plan = big_file(tmp_path / "a")
    with open(a.path(ns, plan.sha1), "rb") as fh:
        whole = fh.read()
    proxy = Proxy(aws.port)
    proxy.hold_up = len(whole) // 2
    child = spawn(
        aws, proxy.endpoint, "upload", a.root, f"s3://{url.bucket}/{url.prefix}", ns, plan.sha1
    )
    try:
        wait_for("half of the upload at the server", proxy.held.is_set, child)
        killed(child)
    finally:
        proxy.close()

    def reader(name):
        b = Store(str(tmp_path / name / "cache"), space_bytes=1 << 30)
        b.ensure_namespace(BIG_FP)
        tier = tier_of(b, url)
        job = fetch_into(b, tier, ns, p, usable=BIG_TOKENS)
        tier.close()
        return b, job

    assert url.key(ns, plan.sha1) not in bucket_keys(aws, url, ns)
    b, job = reader("b")
    assert job is None or job.installed == []
    assert planner(b).lookup(ns, p.ids, BIG_TOKENS).tokens == 0
    assert b.temp_files() == [] and verify(b).ok

    tier_a = tier_of(a, url)  # the restarted replica uploads the file again
    tier_a.saved(ns, plan.sha1)
    assert tier_a.drain(60)
    assert counts(tier_a) == {"uploaded": 1}
    tier_a.close()
    c, job = reader("c")
    assert job.installed == [plan.sha1] and not job.reason
    assert planner(c).lookup(ns, p.ids, BIG_TOKENS).tokens == BIG_TOKENS
    with open(c.path(ns, plan.sha1), "rb") as fh:
        assert fh.read()[48:] == whole[48:]
    assert verify(c).ok


def test_kill_during_a_fetch_leaves_nothing_a_reader_would_use(aws, tmp_path):
    """The fetching process is killed (SIGKILL) with part of the object written into its
    temp file: the directory holds no checkpoint of the name (a restart looks it up as a
    miss), a fetch after the restart installs the whole file, and the next listing of the
    directory past the temp file's grace removes it."""
    url = url_of(aws)
    a, ns, p, plan = uploaded_big_file(tmp_path / "a", url)
    b = Store(str(tmp_path / "b" / "cache"), space_bytes=1 << 30)
    assert b.ensure_namespace(BIG_FP) == ns
    names = prefix_names(byte_table(), p.ids, BLOCK, BIG_TOKENS)
    proxy = Proxy(aws.port)
    proxy.hold_down = 3 * 2**20  # a GET's first 3 MiB reach the process, then nothing
    child = spawn(
        aws,
        proxy.endpoint,
        "fetch",
        b.root,
        f"s3://{url.bucket}/{url.prefix}",
        ns,
        json.dumps(names),
    )
    ns_dir = b.ns_dir(ns)

    def written() -> list[str]:
        return [
            n
            for n in os.listdir(ns_dir)
            if n.startswith(fsdir.TMP_PREFIX) and os.path.getsize(os.path.join(ns_dir, n)) > 0
        ]

    try:
        wait_for(
            "part of the object in a temp file", lambda: proxy.held.is_set() and written(), child
        )
        killed(child)
    finally:
        proxy.close()
    (temp,) = written()
    assert f"{plan.sha1}.kv" not in os.listdir(ns_dir)

    # A restart within seconds (the temp file is young: its writer may not have locked it
    # yet) finds no checkpoint of the name: a miss.
    restarted = Store(b.root, space_bytes=1 << 30)
    assert planner(restarted).lookup(ns, p.ids, BIG_TOKENS).tokens == 0
    assert restarted.index.get(ns, plan.sha1) is None
    old = time.time() - 3600  # from here on, as if the kill were an hour ago
    os.utime(os.path.join(ns_dir, temp), (old, old))
    tier = tier_of(restarted, url)
    job = fetch_into(restarted, tier, ns, p, usable=BIG_TOKENS)
    tier.close()
    assert job.installed == [plan.sha1] and not job.reason
    assert planner(restarted).lookup(ns, p.ids, BIG_TOKENS).tokens == BIG_TOKENS
    with open(a.path(ns, plan.sha1), "rb") as fa, open(restarted.path(ns, plan.sha1), "rb") as fb:
        assert fa.read()[48:] == fb.read()[48:]
    # The fetch changed the directory: its next listing removed the dead writer's file.
    assert restarted.temp_files() == [] and temp not in os.listdir(ns_dir)
    assert verify(restarted).ok


def answered_by(job):
    """Seconds until the request waiting on ``job`` goes on (the scheduler's own test)."""
    while not job.settled(time.monotonic()):
        time.sleep(0.02)
    return time.monotonic() - job.started


def test_store_slow_is_a_miss_at_the_deadline_then_serves_again(aws, tmp_path, monkeypatch):
    """A store that answers, slowly (a proxy passes 64 KiB/s of each response): requests
    that wait on a 12 MiB object go on at the deadline, however many come, and what the
    slow downloads finish once the store is fast again is installed whole."""
    url = url_of(aws)
    a, ns, p, plan = uploaded_big_file(tmp_path / "a", url)
    proxy = Proxy(aws.port)
    proxy.rate = 64 * 1024
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    b = Store(str(tmp_path / "b" / "cache"), space_bytes=1 << 30)
    b.ensure_namespace(BIG_FP)
    deadline_s = 2.0
    tier_b = tier_of(b, url, timeout_s=5.0, deadline_s=deadline_s)
    names = lambda: prefix_names(byte_table(), p.ids, BLOCK, BIG_TOKENS)  # noqa: E731
    try:
        jobs = []
        for _ in range(3):  # one request after another, while the store stays slow
            job = tier_b.fetch(ns, names, 0, lambda s: b.index.get(ns, s) is not None)
            assert job is not None
            waited = answered_by(job)
            assert deadline_s <= waited < deadline_s + 5.0
            assert job.reason.startswith("deadline") and job.installed == []
            jobs.append(job)
        assert planner(b).lookup(ns, p.ids, BIG_TOKENS).tokens == 0
        proxy.rate = None  # the store is fast again
        assert jobs[0].done.wait(60)
        got = tier_b.fetch(ns, names, 0, lambda s: b.index.get(ns, s) is not None)
        assert got is None or (got.done.wait(60) and not got.installed)
    finally:
        proxy.rate = None
        tier_b.close()
        proxy.close()
    assert planner(b).lookup(ns, p.ids, BIG_TOKENS).tokens == BIG_TOKENS
    with open(a.path(ns, plan.sha1), "rb") as fa, open(b.path(ns, plan.sha1), "rb") as fb:
        assert fa.read()[48:] == fb.read()[48:]
    assert verify(b).ok


def test_a_fetch_asks_the_store_once_per_range(aws, tmp_path):
    """Per-request overhead: a fetch lists once and makes one ranged GET per 8 MiB of
    each object, its first telling the size (no HEAD before it: a round trip per file)."""
    url = url_of(aws)
    a, ns, p, plan = uploaded_big_file(tmp_path / "a", url)
    b = Store(str(tmp_path / "b" / "cache"), space_bytes=1 << 30)
    b.ensure_namespace(BIG_FP)
    tier_b = tier_of(b, url)
    calls = []
    tier_b.bucket.client.meta.events.register(
        "before-call.s3", lambda model, **_: calls.append(model.name)
    )
    job = fetch_into(b, tier_b, ns, p, usable=BIG_TOKENS)
    tier_b.close()
    assert job.installed == [plan.sha1] and verify(b).ok
    assert sorted(calls) == ["GetObject", "GetObject", "ListObjectsV2"]  # 12 MiB: 2 ranges


def test_an_idle_step_waits_for_a_fetch_and_a_step_with_work_never(tmp_path):
    """An engine step that computes nothing while a request waits on its fetch waits for
    the fetch a little, the GIL released (an in-process engine's loop spins otherwise and
    starves the fetch's threads: 0.33 of the store's speed); a step with work never."""
    import threading

    from vllm_kvdisk.connector.objectfetch import IDLE_WAIT_S, ObjectFetches
    from vllm_kvdisk.core.index import Index
    from vllm_kvdisk.ops.trace import Trace
    from vllm_kvdisk.storage.objecttier import Fetch

    waits = []

    class Done(threading.Event):  # records how long each wait may last
        def wait(self, timeout=None):
            waits.append(timeout)
            return super().wait(timeout)

    job = Fetch("ns", time.monotonic() + 60, time.monotonic(), done=Done())

    class Tier:
        def fetch(self, *args):
            return job

    fetches = ObjectFetches(Tier(), Index(), byte_table(), BLOCK, 1, Trace(None))
    assert fetches.idle(0) is False  # nobody waits on a fetch
    assert fetches.start("r", "ns", prompt(1).ids, 64, 0, list)
    assert fetches.idle(128) is False and waits == []  # the step had work
    assert fetches.idle(0) is True and waits == [IDLE_WAIT_S]
    job.done.set()
    assert fetches.waiting("r") is False
    assert fetches.idle(0) is False and waits == [IDLE_WAIT_S]
