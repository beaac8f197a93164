"""Cost-aware loading: `auto` against `always` on a fast store and on a slow one.

    .venv/bin/python benchmarks/policy_bench.py [--prompt-tokens 4096] [--requests 4]
                                                [--slow-mbps 5]

One run, real vLLM engines (in-process, so the throttle below reaches the worker):
  1. a writer engine prefills --requests distinct long prompts; their checkpoints land on
     disk, and the engine is shut down;
  2. for each store (fast: the files as they are, in the page cache of a local disk;
     slow: every layer read also waits on a shared token bucket of --slow-mbps MB/s,
     standing in for a busy network volume) and each policy in the order always, auto,
     auto, always (so drift and warm-up hit both policies alike), a fresh engine
     on the same directory first prefills one unrelated prompt (every server has traffic;
     this is the prefill speed the policy measures), then is sent each long prompt once:
     the device cache is empty, so each is a disk hit that is either loaded or recomputed.
Prints time to first token per request and in total, what the policy did (files loaded,
"cheaper to recompute" declines), and checks that every configuration answered with the
same tokens. The first restore of `auto` always loads: that is what measures the store.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np
from common import close, kv_bytes_per_token, make_llm, model_shape

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


class TokenBucket:
    """A shared read-bandwidth limit: each read waits until the bucket has room for it."""

    def __init__(self, bytes_per_s: float):
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0

    def take(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + nbytes / self.rate
            wait = self._free_at - now
        time.sleep(wait)


def throttle_reads(bucket: TokenBucket | None) -> None:
    """Make the restore path's layer reads wait on ``bucket``; None undoes it."""
    import vllm_kvdisk.connector.restore as restore_mod
    import vllm_kvdisk.storage.pageread as fmt

    if bucket is None:
        restore_mod.read_layer_into = fmt.read_layer_into
        restore_mod.read_layers_into = fmt.read_layers_into
        return

    def slow_layer(fd, meta, layer, out):
        fmt.read_layer_into(fd, meta, layer, out)
        bucket.take(meta.offsets.layer_bytes)

    def slow_layers(fd, meta, first, outs):
        fmt.read_layers_into(fd, meta, first, outs)
        bucket.take(meta.offsets.layer_bytes * len(outs))

    restore_mod.read_layer_into = slow_layer
    restore_mod.read_layers_into = slow_layers


def first_token(llm, prompt: list[int]) -> tuple[float, int, int]:
    """(seconds to the first token, the token, prompt tokens served from a cache)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return time.perf_counter() - t0, out.outputs[0].token_ids[0], out.num_cached_tokens or 0


def declined(trace_path: str) -> int:
    from vllm_kvdisk.ops.trace import read

    return sum("cheaper to recompute" in e.detail for e in read(trace_path, ["miss"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--slow-mbps", type=float, default=5.0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "policy_bench.txt")
    )
    args = ap.parse_args()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    work = tempfile.mkdtemp(prefix="kvdisk-policy-bench-")
    shape = model_shape(args.hidden, args.layers)
    kv_per_token = kv_bytes_per_token(shape)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 4000, args.prompt_tokens).tolist() for _ in range(args.requests)]
    try:
        model = str(build_tiny_model(os.path.join(work, "model"), shape=shape))
        kv = os.path.join(work, "kv")
        writer = make_llm(
            model, kv, trace=os.path.join(work, "writer.trace"), kv_disk_load_policy="always"
        )
        cold = [first_token(writer, p)[0] for p in prompts]
        close(writer)
        disk_mb = (
            sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(kv) for f in fs) / 1e6
        )
        say(
            f"model {shape}: {kv_per_token // 1024} KiB of KV per token (fp32); "
            f"{args.requests} prompts of {args.prompt_tokens} tokens, {disk_mb:.0f} MB on disk; "
            f"cold prefill median {statistics.median(cold) * 1e3:.0f} ms"
        )
        rows, answers = [], {}
        for store, bucket in (
            ("fast", None),
            (f"slow {args.slow_mbps:g} MB/s", TokenBucket(args.slow_mbps * 1e6)),
        ):
            for policy in ("always", "auto", "auto", "always"):  # ABBA: drift hits both alike
                throttle_reads(bucket)
                trace = os.path.join(work, f"{store.split()[0]}-{policy}-{len(rows)}.trace")
                llm = make_llm(model, kv, trace=trace, kv_disk_load_policy=policy)
                first_token(llm, rng.integers(10, 4000, 2048).tolist())  # other traffic
                ttfts, tokens, cached = [], [], []
                for p in prompts:
                    seconds, token, hit = first_token(llm, p)
                    ttfts.append(seconds)
                    tokens.append(token)
                    cached.append(hit)
                close(llm)
                throttle_reads(None)
                answers[(store, policy, len(rows))] = tokens
                rows.append((store, policy, ttfts, cached, declined(trace)))
        say(
            f"{'store':<16}{'policy':<8}{'TTFT per request (ms)':<36}{'total':>8}"
            f"{'tokens loaded':>15}{'declined':>10}"
        )
        totals: dict[tuple[str, str], float] = {}
        for store, policy, ttfts, cached, n_declined in rows:
            per = " ".join(f"{t * 1e3:.0f}" for t in ttfts)
            totals[(store, policy)] = totals.get((store, policy), 0.0) + sum(ttfts)
            say(
                f"{store:<16}{policy:<8}{per:<36}{sum(ttfts) * 1e3:8.0f}{sum(cached):>15}"
                f"{n_declined:>10}"
            )
        for store in dict.fromkeys(s for s, _ in totals):
            ratio = totals[(store, "always")] / totals[(store, "auto")]
            say(
                f"{store}: always/auto total TTFT over both runs = {ratio:.2f} "
                f"({'auto faster' if ratio > 1.05 else 'tie' if ratio > 0.95 else 'auto slower'})"
            )
        same = len({tuple(v) for v in answers.values()}) == 1
        say(f"first tokens identical across all configurations: {same}")
        say(
            f"command: python benchmarks/policy_bench.py --prompt-tokens {args.prompt_tokens} "
            f"--requests {args.requests} --slow-mbps {args.slow_mbps:g}"
        )
        pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
        if not same:
            raise SystemExit("token mismatch between configurations")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
