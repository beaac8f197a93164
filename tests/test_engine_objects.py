"""Replicas without a shared volume, sharing through a real S3 server (SeaweedFS): engine
A saves on its own directory and uploads; engine B on an empty directory restores the
prompt from the bucket with the greedy tokens of no cache; a corrupt object is caught,
quarantined, deleted, recomputed and uploaded again sound; a store that is down costs a
miss, not the answer."""

import glob
import os
import time
import uuid

import pytest
from engine import OUTCOME_WAIT_S, engine, events, generate, random_prompt, wait_until
from helpers import kv_files

from vllm_kvdisk.core.objects import ObjectUrl
from vllm_kvdisk.storage.objectstore import Bucket

# A fetch that must succeed may take as long as the engine tests' hang guard: the store's
# speed (a TP 2 replica on a 2-CPU CI machine once fetched 5 MB in over 10 s, the
# default deadline) is never the verdict. Only D tests the deadline, with its own.
FETCH = {"kv_object_deadline_s": int(OUTCOME_WAIT_S)}

pytestmark = pytest.mark.engine


def test_empty_disk_restores_from_the_object_store(tiny_model, seaweed, tmp_path, monkeypatch):
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    url = f"s3://{seaweed.bucket}/engine-{uuid.uuid4().hex[:8]}"
    bucket = Bucket(ObjectUrl.parse(url), timeout_s=60.0)
    trace = {n: str(tmp_path / f"trace-{n}.txt") for n in "abcd"}
    kv = {n: str(tmp_path / f"kv-{n}") for n in "abcd"}
    prompt = random_prompt(1500, seed=11)
    with engine(tiny_model, None, prefix_caching=False) as llm:
        reference, _ = generate(llm, prompt, max_tokens=16)

    # A saves on its own disk; its saves are uploaded behind the engine's back.
    with engine(tiny_model, kv["a"], kv_object_url=url, trace=trace["a"], **FETCH) as llm:
        cold, cached = generate(llm, prompt, max_tokens=16)
        assert cached == 0
        wait_until("A's checkpoint saved", lambda: len(kv_files(kv["a"])) >= 1)
        (ns,) = {os.path.basename(os.path.dirname(p)) for p in kv_files(kv["a"])}

        def uploaded() -> bool:
            local = {os.path.basename(p)[:-3] for p in kv_files(kv["a"])}
            return local <= bucket.list_names(ns)

        wait_until("A's checkpoints uploaded", uploaded)
    names = bucket.list_names(ns)

    # B: an empty disk, the same bucket: the prefix comes from the object store.
    with engine(tiny_model, kv["b"], kv_object_url=url, trace=trace["b"], **FETCH) as llm:
        restored, cached = generate(llm, prompt, max_tokens=16)
    assert cached == 1408  # the deepest checkpoint below 1500 (grid 256/32, block 128)
    assert restored == cold == reference
    hits = events(trace["b"], "hit")
    assert any("source=object" in e.detail for e in hits), hits
    (fetch,) = events(trace["b"], "object_fetch")
    assert fetch.files >= 1 and fetch.detail == ""
    assert {os.path.basename(p)[:-3] for p in kv_files(kv["b"])} <= names

    # C: the deepest object corrupted in the bucket: caught, quarantined, deleted, and
    # the prompt is served from the sound part of the chain or recomputed, exactly.
    deepest = max(names, key=lambda s: os.path.getsize(os.path.join(kv["a"], ns, f"{s}.kv")))
    with open(os.path.join(kv["a"], ns, f"{deepest}.kv"), "rb") as fh:
        data = bytearray(fh.read())
    data[-64] ^= 0xFF  # a page byte of the last layer
    seaweed.client().put_object(
        Bucket=seaweed.bucket, Key=ObjectUrl.parse(url).key(ns, deepest), Body=bytes(data)
    )
    with engine(tiny_model, kv["c"], kv_object_url=url, trace=trace["c"], **FETCH) as llm:
        answer, cached = generate(llm, prompt, max_tokens=16)
    assert answer == reference
    assert cached < 1408
    assert len(glob.glob(os.path.join(kv["c"], "quarantine", "*.kv"))) == 1
    # The corrupt object was deleted; C recomputed and saved the prefix, and its upload
    # put a sound object under the name again.
    key = ObjectUrl.parse(url).key(ns, deepest)

    def healed() -> bool:
        try:
            body = seaweed.client().get_object(Bucket=seaweed.bucket, Key=key)["Body"].read()
        except Exception:  # noqa: BLE001 - not there (yet)
            return False
        with open(os.path.join(kv["c"], ns, f"{deepest}.kv"), "rb") as fh:
            return body[48:] == fh.read()[48:] != bytes(data[48:])

    wait_until("the corrupt object replaced by C's sound one", healed)

    # D: the store is down: answered without it, within the fetch deadline.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with engine(
        tiny_model, kv["d"], kv_object_url=url, kv_object_deadline_s=3, trace=trace["d"]
    ) as llm:
        started = time.monotonic()
        answer, cached = generate(llm, prompt, max_tokens=16)
        took = time.monotonic() - started
    assert answer == reference and cached == 0
    assert took < 60  # the deadline is 3 s; the rest is the prefill on this CPU
    (fetch,) = events(trace["d"], "object_fetch")
    assert fetch.files == 0 and fetch.detail.startswith("object store:")
