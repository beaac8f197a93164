"""What a replica's listing of the bucket costs, on a real S3 server (SeaweedFS).

    .venv/bin/python benchmarks/object_listing.py [--objects 100000] [--threads 16]

Puts N small objects named like checkpoints under one namespace, then times the listing
the object tier makes (``Bucket.list_names``: pages of 1000 keys) and a prompt's candidate
names (``prefix_names`` for a 128k-token prompt, block 16). A replica lists at its first
lookup in a namespace and then only in the background (every 60 s, or 5 s after a lookup
the bucket did not serve), so the listing is never on a lookup's path after the first.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from vllm_kvdisk.core.objects import ObjectUrl, prefix_names
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.storage.objectstore import Bucket
from vllm_kvdisk.testing.seaweed import SeaweedS3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, default=100000)
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedS3(tmp).start()
        try:
            os.environ.update(server.env())
            url = ObjectUrl.parse(f"s3://{server.bucket}/bench")
            ns = "00112233aabbccdd"
            client = server.client()
            names = [hashlib.sha1(str(i).encode()).hexdigest() for i in range(args.objects)]

            def put(sha1: str) -> None:
                client.put_object(Bucket=server.bucket, Key=url.key(ns, sha1), Body=b"x")

            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(put, names))
            put_s = time.perf_counter() - t0
            bucket = Bucket(url, timeout_s=30.0)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                found = bucket.list_names(ns)
                times.append(time.perf_counter() - t0)
            assert found == set(names), (len(found), len(names))
            table = TokenTable([bytes([i]) for i in range(256)])
            ids = np.random.default_rng(0).integers(0, 256, 131072)
            t0 = time.perf_counter()
            cands = prefix_names(table, ids, 16, len(ids))
            names_s = time.perf_counter() - t0
            print(f"objects: {args.objects} (put in {put_s:.1f} s)")
            print(
                f"listing: best {min(times):.2f} s, median {sorted(times)[1]:.2f} s "
                f"({min(times) / args.objects * 1e6:.1f} us per object)"
            )
            print(
                f"candidate names of a 131072-token prompt: {len(cands)} in {names_s * 1e3:.1f} ms"
            )
            bucket.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
