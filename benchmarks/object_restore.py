"""A restore from the object tier against recompute and the local tier, on a real S3
server (SeaweedFS), in one run.

    .venv/bin/python benchmarks/object_restore.py [--tokens 10000]

Engine A saves the prompt on its own directory and uploads it. Then, side by side on one
prompt (1 new token each, prefill-bound): an engine without a cache (recompute); engine B
on an empty directory with the same bucket (fetch from the object store + restore); the
same engine B again after its device cache is reset (the local tier, the files B just
fetched). The fetch's GET throughput (bytes fetched / its traced time, checks and
adoption included) is compared with a raw parallel download of the same objects (8
threads, whole GETs, into memory). Prints the times and the ratios (goal: GET throughput
>= 0.8 of the raw download).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from common import close, make_llm, model_shape
from engine_bench import timed_generate

from vllm_kvdisk.core.objects import ObjectUrl
from vllm_kvdisk.ops.trace import read
from vllm_kvdisk.storage.objectstore import Bucket
from vllm_kvdisk.testing.seaweed import SeaweedS3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10000)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # as engine_bench
    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    work = tempfile.mkdtemp(prefix="kvdisk-object-restore-")
    server = SeaweedS3(work).start()
    try:
        os.environ.update(server.env())
        url = f"s3://{server.bucket}/bench-{uuid.uuid4().hex[:8]}"
        model = str(
            build_tiny_model(
                os.path.join(work, "model"), shape=model_shape(args.hidden, args.layers)
            )
        )
        prompt = np.random.default_rng(0).integers(10, 4000, args.tokens).tolist()
        kv_a, kv_b = os.path.join(work, "kv-a"), os.path.join(work, "kv-b")
        trace_b = os.path.join(work, "trace-b.log")

        a = make_llm(model, kv_a, kv_object_url=url)
        timed_generate(a, [prompt], 1)
        close(a)  # the worker's shutdown lets its queued uploads finish
        (ns,) = [d for d in os.listdir(kv_a) if len(d) == 16]  # the one namespace
        bucket = Bucket(ObjectUrl.parse(url), timeout_s=30.0)
        names = sorted(bucket.list_names(ns))

        plain = make_llm(model, None)
        timed_generate(plain, [prompt[:64]], 1)  # warm-up
        recompute_s = timed_generate(plain, [prompt], 1)
        close(plain)

        b = make_llm(model, kv_b, kv_object_url=url, trace=trace_b)
        object_s = timed_generate(b, [prompt], 1)
        b.reset_prefix_cache()
        local_s = timed_generate(b, [prompt], 1)
        close(b)
        fetches = read(trace_b, ["object_fetch"])
        fetch = next(f for f in fetches if f.files)
        loaded = read(trace_b, ["loaded"])

        client = server.client()

        def get(sha1: str) -> int:
            body = client.get_object(Bucket=server.bucket, Key=ObjectUrl.parse(url).key(ns, sha1))
            return len(body["Body"].read())

        with ThreadPoolExecutor(8) as pool:
            t0 = time.perf_counter()
            raw_bytes = sum(pool.map(get, names))
            raw_s = time.perf_counter() - t0
        fetch_rate = fetch.bytes / (fetch.ms / 1e3)
        raw_rate = raw_bytes / raw_s
        print(f"{args.tokens} tokens, {len(names)} object(s), {fetch.bytes / 2**20:.1f} MiB")
        print(f"recompute        {recompute_s * 1e3:8.0f} ms")
        print(
            f"object tier      {object_s * 1e3:8.0f} ms  (fetch {fetch.ms:.0f} ms, "
            f"restore {loaded[0].ms:.0f} ms, {loaded[0].tokens} tokens)"
        )
        print(f"local tier       {local_s * 1e3:8.0f} ms")
        print(
            f"object/recompute {object_s / recompute_s:.2f}   local/recompute "
            f"{local_s / recompute_s:.2f}   object/local {object_s / local_s:.2f}"
        )
        print(
            f"GET throughput   {fetch_rate / 2**20:.0f} MiB/s vs raw parallel download "
            f"{raw_rate / 2**20:.0f} MiB/s: ratio {fetch_rate / raw_rate:.2f} (goal >= 0.8)"
        )
        bucket.close()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
