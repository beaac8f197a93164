"""Drive real vLLM engines and servers: one harness for the tests and the benchmarks.

* :func:`engine`: an in-process ``LLM`` (engine and worker in this process, fp32, eager),
  optionally with the disk cache on a directory; :func:`generate` returns the greedy
  tokens and how many prompt tokens were cached.
* :class:`Server`: a server process (``vllm-kvdisk serve`` or plain ``vllm serve``) on
  127.0.0.1, ready when ``/health`` answers; chat, tokenize, metrics, device-cache reset,
  and a stop by SIGTERM (as Kubernetes does) or SIGKILL.

vLLM and requests are imported when used, so a caller can set vLLM's environment first.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

# The CPU build's `vllm` console script is broken (it asks for a distribution named
# "vllm"); serve.py's workaround, then vLLM's own CLI.
LAUNCH_VLLM = (
    "import sys; from vllm_kvdisk.serve import _patch_cpu_build_version; "
    "_patch_cpu_build_version(); from vllm.entrypoints.cli.main import main; "
    "sys.argv = ['vllm', 'serve', *sys.argv[1:]]; main()"
)


def random_prompt(n: int, seed: int, low: int = 10, high: int = 4000) -> list[int]:
    return np.random.default_rng(seed).integers(low, high, n).tolist()


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


# -- in-process engines ------------------------------------------------------------------
def kvdisk_transfer_config(kv_dir: str, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="kvdisk",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kv_disk_dir": kv_dir, **extra},
    )


def make_llm(
    model: str,
    kv_dir: str | None,
    *,
    prefix_caching: bool = True,
    max_model_len: int = 8192,
    llm_args: dict | None = None,
    **extra: Any,
) -> Any:
    """An engine on ``model`` (fp32, eager), with kvdisk on ``kv_dir`` (``extra``: its
    config keys)."""
    from vllm import LLM

    kwargs = dict(llm_args or {})
    if kv_dir is not None:
        kwargs["kv_transfer_config"] = kvdisk_transfer_config(kv_dir, **extra)
    kwargs.setdefault("dtype", "float32")
    return LLM(
        model=model,
        enforce_eager=True,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
        **kwargs,
    )


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@contextlib.contextmanager
def engine(model: str, kv_dir: str | None, **kwargs: Any) -> Iterator[Any]:
    """An in-process engine (engine and worker in this process, for speed)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = make_llm(model, kv_dir, **kwargs)
    try:
        yield llm
    finally:
        close(llm)


def generate(
    llm: Any,
    prompt: list[int],
    max_tokens: int = 16,
    salt: str | None = None,
    kv_params: dict | None = None,
) -> tuple[list[int], int]:
    """Greedy tokens for one prompt and the number of its tokens that were cached."""
    from vllm import SamplingParams

    req: dict[str, Any] = {"prompt_token_ids": prompt}
    if salt:
        req["cache_salt"] = salt
    extra = {"kv_transfer_params": kv_params} if kv_params else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=extra)
    out = llm.generate([req], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


# -- server processes --------------------------------------------------------------------
def kvdisk_command(model: str, kv_dir: str, port: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm_kvdisk.serve",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-disk-dir",
        kv_dir,
        *args,
    ]


def vllm_command(model: str, port: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        LAUNCH_VLLM,
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]


def error_from_log(path: str) -> str:
    """The first exception message in a failed server's log (the root cause, usually)."""
    try:
        lines = pathlib.Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for line in lines:
        msg = line.split("] ", 1)[1] if line.startswith("(") and "] " in line else line
        if re.match(r"[\w.]*(Error|Exception): ", msg.strip()):
            return msg.strip()[:400]
    return (lines[-1].strip() if lines else "empty log")[:400]


class Server:
    """A server process on 127.0.0.1:``port``, ready when ``/health`` answers."""

    def __init__(
        self,
        cmd: list[str],
        log_path: str,
        port: int,
        *,
        env: dict[str, str] | None = None,
        model: str = "",
        timeout_s: float = 300,
        cwd: str | None = None,
    ):
        import requests

        self.cmd, self.port, self.model, self.log_path = cmd, port, model, log_path
        self.url = f"http://127.0.0.1:{port}"
        if env is None:
            env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        self._log = open(log_path, "ab")  # noqa: SIM115 - open while the server runs
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=cwd,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during "
                    f"start-up: {error_from_log(log_path)} (log: {log_path})"
                )
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop(kill=True)
        raise RuntimeError(f"server not ready in {timeout_s:.0f} s; see {log_path}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def post(
        self, path: str, body: dict, timeout: float = 300, headers: dict | None = None
    ) -> dict:
        import requests

        r = requests.post(self.url + path, json=body, timeout=timeout, headers=headers)
        r.raise_for_status()
        return r.json()

    def chat(
        self,
        messages: list[dict],
        max_tokens: int = 24,
        headers: dict | None = None,
        **extra: Any,
    ) -> dict:
        return self.post(
            "/v1/chat/completions",
            {
                "model": self.model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                **extra,
            },
            headers=headers,
        )

    def tokenize(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.post(
            "/tokenize",
            {
                "model": self.model,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
            },
        )["tokens"]

    def reset_prefix_cache(self, external: bool = False) -> dict:
        """vLLM's device prefix cache (and with ``external`` the connector's cache too);
        the route needs VLLM_SERVER_DEV_MODE=1 in the server's environment."""
        import requests

        # vLLM refuses the reset ({"success": false}) while blocks are still held: by
        # running requests, or by finished ones whose pages are still being copied out
        # (freed a step or two later). Its documented answer is to retry.
        deadline = time.monotonic() + 60
        while True:
            r = requests.post(
                self.url + "/reset_prefix_cache",
                params={"reset_external": str(external).lower()},
                timeout=60,
            )
            r.raise_for_status()
            out = r.json() if r.content else {}
            if out.get("success", True) or time.monotonic() > deadline:
                return out
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples (full name with labels -> value), model labels dropped."""
        import requests

        out: dict[str, float] = {}
        for line in requests.get(self.url + "/metrics", timeout=30).text.splitlines():
            if not line.startswith("vllm:") or " " not in line:
                continue
            head, value = line.rsplit(" ", 1)
            if "{" in head:
                name, labels = head[:-1].split("{", 1)
                keep = [
                    lb
                    for lb in labels.split(",")
                    if lb and not lb.startswith(("model_name=", "engine="))
                ]
                head = name + ("{" + ",".join(sorted(keep)) + "}" if keep else "")
            with contextlib.suppress(ValueError):
                out[head] = out.get(head, 0.0) + float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples whose labels include ``labels``."""
        total = 0.0
        for head, value in self.metrics().items():
            base = head.split("{", 1)[0]
            if base == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += value
        return total

    def stop(self, *, kill: bool = False, timeout_s: float = 120) -> dict:
        """SIGTERM to the main process only (as Kubernetes does), or SIGKILL to the whole
        process group (a crash); waits until every process of it is gone."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            if kill:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        deadline, lingered = time.monotonic() + 60, False
        while True:  # the engine and workers exit after the main process: wait for them
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            if time.monotonic() > deadline:
                lingered = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                time.sleep(1)
                break
            time.sleep(0.2)
        if not self._log.closed:
            self._log.close()
        return {
            "rc": self.proc.returncode,
            "stop_s": round(time.perf_counter() - t0, 2),
            "killed_lingering_children": lingered,
        }


def hold_lock(root: str) -> subprocess.Popen[str]:
    """Another process holding ``root/.lock`` (``flock``) until its stdin closes."""
    proc = subprocess.Popen(
        ["flock", os.path.join(root, ".lock"), "sh", "-c", "echo held; read line"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    if proc.stdout is None or proc.stdout.readline() != "held\n":
        raise RuntimeError(f"could not hold {root}/.lock")
    return proc
