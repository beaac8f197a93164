"""An object-tier fetch of a chain of checkpoints against a raw parallel download of the
same objects, on a real S3 server (SeaweedFS), without an engine.

    .venv/bin/python benchmarks/object_fetch.py [--files 8] [--mib 6] [--reps 3]

A chain of ``--files`` synthetic checkpoints of ``--mib`` MiB each is uploaded; then, side
by side in each round, a raw download of every object (8 threads, whole GETs, into
memory) and a fetch into an empty directory (``ObjectTier.fetch``: GETs into temp files,
whole-file checks, sync, adoption). Prints each round's throughputs and their ratio
(goal: >= 0.8); ``benchmarks/object_restore.py`` measures the same inside an engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from vllm_kvdisk.core.encode import encode_plan
from vllm_kvdisk.core.format import PageLayout, Reason
from vllm_kvdisk.core.keys import Fingerprint
from vllm_kvdisk.core.objects import ObjectUrl, prefix_names
from vllm_kvdisk.core.planner import Planner, Prompt
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.storage.objectstore import Bucket
from vllm_kvdisk.storage.objecttier import ObjectTier
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.testing.seaweed import SeaweedS3

BLOCK = 16
LAYOUT = PageLayout("bench:LBHNC", BLOCK, 2, (2, BLOCK, 512), "float32")  # 8 KiB a token
FP = Fingerprint("bench", "main", "float32", LAYOUT.name, BLOCK, 1, 0)


def chain(store: Store, files: int, tokens_each: int) -> tuple[str, Prompt, TokenTable]:
    """``files`` checkpoints of one prompt, each ``tokens_each`` deeper than its parent."""
    ns = store.ensure_namespace(FP)
    table = TokenTable([bytes([i]) for i in range(256)])
    prompt = Prompt(table, np.random.default_rng(0).integers(0, 256, files * tokens_each + 1))
    planner = Planner(store.index, BLOCK, store.read_ids, 1)
    rng = np.random.default_rng(1)
    for i in range(1, files + 1):
        plan = planner.plan_save(ns, prompt, i * tokens_each, Reason.COLD)
        if plan is None:
            raise RuntimeError("nothing to save")
        blocks = (plan.tokens - plan.parent_tokens) // BLOCK
        layers = [
            rng.random((blocks, *LAYOUT.page_shape), dtype=np.float32).tobytes() for _ in range(2)
        ]
        enc = encode_plan(
            plan,
            text=prompt.text_upto(plan.tokens),
            ids=prompt.ids,
            layers=layers,
            layout=LAYOUT,
            fingerprint=FP.digest(),
            kv_dtype="float32",
            context_size=1 << 20,
            now=1,
        )
        store.write(ns, plan.sha1, enc)
    return ns, prompt, table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--mib", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tokens_each = args.mib * 2**20 // (8 * 1024) // BLOCK * BLOCK
    with tempfile.TemporaryDirectory() as work:
        server = SeaweedS3(work).start()
        try:
            os.environ.update(server.env())
            url = ObjectUrl.parse(f"s3://{server.bucket}/bench-{uuid.uuid4().hex[:8]}")
            source = Store(os.path.join(work, "a"), space_bytes=1 << 34)
            ns, prompt, table = chain(source, args.files, tokens_each)
            uploader = ObjectTier(source, Bucket(url, timeout_s=30.0), deadline_s=60.0)
            names = sorted(e.sha1 for e in source.index.namespace_entries(ns))
            for sha1 in names:
                uploader.saved(ns, sha1)
            if not uploader.drain(300):
                raise RuntimeError("uploads did not finish")
            uploader.close()
            client = server.client()

            def get(sha1: str) -> int:
                got = client.get_object(Bucket=server.bucket, Key=url.key(ns, sha1))
                return len(got["Body"].read())

            candidates = prefix_names(table, prompt.ids, BLOCK, len(prompt.ids) - 1)
            total = 0
            ratios = []
            print(f"{len(names)} objects, {sum(map(get, names)) / 2**20:.1f} MiB")
            for rep in range(args.reps):
                with ThreadPoolExecutor(8) as pool:
                    t0 = time.perf_counter()
                    total = sum(pool.map(get, names))
                    raw_s = time.perf_counter() - t0
                store = Store(os.path.join(work, f"b{rep}"), space_bytes=1 << 34)
                store.ensure_namespace(FP)
                tier = ObjectTier(store, Bucket(url, timeout_s=30.0), deadline_s=120.0)
                listed = tier.fetch(ns, list, 0, lambda s: False)  # the listing, not timed
                if listed is not None:
                    listed.done.wait(60)
                t0 = time.perf_counter()
                job = tier.fetch(
                    ns, lambda: candidates, 0, lambda s, i=store.index: i.get(ns, s) is not None
                )
                if job is None or not job.done.wait(300) or job.reason:
                    raise RuntimeError(f"fetch failed: {job and job.reason}")
                fetch_s = time.perf_counter() - t0
                tier.close()
                if job.nbytes != total or len(job.installed) != len(names):
                    raise RuntimeError(f"fetched {len(job.installed)} of {len(names)} files")
                ratio = raw_s / fetch_s
                ratios.append(ratio)
                print(
                    f"round {rep + 1}: raw {total / raw_s / 2**20:5.0f} MiB/s, fetch "
                    f"{total / fetch_s / 2**20:5.0f} MiB/s (checks, sync, adoption included): "
                    f"ratio {ratio:.2f}"
                )
            print(f"median ratio {statistics.median(ratios):.2f} (goal >= 0.8)")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
