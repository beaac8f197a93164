"""Helpers to drive a real vLLM engine: in-process ``LLM`` and a ``vllm-kvdisk serve``."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Iterator

import numpy as np
import requests

ALIGN = 256  # small grid so tests stay fast: checkpoints at 128, 384, 640, ... (block 128)
# "always": tests assert exact hit counts; the cost-aware default is tested on its own.
CFG = {"kv_cache_boundary_align_tokens": ALIGN, "kv_cache_min_tokens": 128,
       "kv_disk_load_policy": "always"}


def random_prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 4000, n).tolist()


@contextlib.contextmanager
def engine(model: str, kv_dir: str | None, *, prefix_caching: bool = True,
           **extra) -> Iterator:
    """An in-process engine (engine and worker in this process, for speed)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = {}
    if kv_dir is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="kvdisk", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"kv_disk_dir": kv_dir, **CFG, **extra})
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=8192,
              enable_prefix_caching=prefix_caching, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm, prompt: list[int], max_tokens: int = 16, salt: str | None = None):
    from vllm import SamplingParams

    req = {"prompt_token_ids": prompt}
    if salt:
        req["cache_salt"] = salt
    out = llm.generate([req], SamplingParams(temperature=0, max_tokens=max_tokens),
                       use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm-kvdisk serve`` in its default multi-process mode, on 127.0.0.1."""

    def __init__(self, model: str, kv_dir: str, log_path: str, *args: str):
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /reset_prefix_cache to evict the device cache
        cmd = [sys.executable, "-m", "vllm_kvdisk.serve", "serve", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", "8192", "--enforce-eager", "--kv-disk-dir", kv_dir,
               "--kv-cache-boundary-align-tokens", str(ALIGN), "--kv-cache-min-tokens", "128",
               "--kv-disk-load-policy", "always",
               "--shutdown-timeout", "20", *args]
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {log_path}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready in time; see {log_path}")

    def chat(self, messages: list[dict], max_tokens: int = 24, **extra) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, **extra}
        r = requests.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        return r.json()

    def tokenize(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        r = requests.post(self.url + "/tokenize", json={
            "model": self.model, "messages": messages,
            "add_generation_prompt": add_generation_prompt}, timeout=60)
        r.raise_for_status()
        return r.json()["tokens"]

    def reset_device_cache(self) -> None:
        requests.post(self.url + "/reset_prefix_cache", timeout=30).raise_for_status()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels``."""
        text = requests.get(self.url + "/metrics", timeout=30).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def stop(self) -> int:
        """SIGTERM to the server process only, as Kubernetes does; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def trace_lines(path: str, word: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [line for line in fh if f"KV cache: {word}" in line]
