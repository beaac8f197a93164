"""Multi-turn agent replay against `vllm serve`, in every cache configuration, one run.

    .venv/bin/python benchmarks/agent_replay.py [--sessions 4] [--turns 8] [--concurrency 2]

A workload generator and driver. N sessions x M turns of an agent conversation, sent as
streamed chat completions to a real OpenAI-compatible vLLM server on 127.0.0.1:
  - every session starts with the same system prompt, which carries a JSON tool block
    rendered as text (no tool parser needed), then its own task;
  - each later turn appends the model's reply and a user message holding a "tool result"
    of configurable length, so the context grows every turn;
  - sessions run concurrently (--concurrency threads), each one's turns in order.
Phases, per configuration: warm (turns 1..M/2), server restart (SIGTERM to the main
process, then a new server on the same cache directory), resumed (turns M/2+1..M).
Configurations (server command lines, printed in the output):
  none     plain vLLM, --no-enable-prefix-caching
  prefix   plain vLLM, its prefix cache only (the default)
  kvdisk   python -m vllm_kvdisk.serve ... --kv-disk-dir DIR (small 256-token grid)
  example  plain vLLM + the in-tree ExampleConnector (shared_storage_path=DIR)
  native   plain vLLM --kv-offloading-backend native --kv-offloading-size N (host memory);
           a configuration whose server does not start is recorded with its error.
Per request it records TTFT (time to the first streamed content chunk), total time,
prompt and cached tokens (usage.prompt_tokens_details); per phase the server's own
counters of computed / device-cached / connector-loaded prompt tokens; per configuration
the bytes and files in its cache directory. Writes benchmarks/results/agent_replay.json
(raw), agent_replay.txt (the table printed here) and agent_replay_{ttft,tokens}.png.

The model is a random-weight tiny Llama and the machine may be a small CPU box: absolute
times say little about GPU serving; compare configurations with each other.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import importlib.metadata as md
import json
import os
import pathlib
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

import numpy as np
import requests

from common import kv_bytes_per_token, model_shape

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
ALL_CONFIGS = ["none", "prefix", "kvdisk", "example", "native"]
LABELS = {
    "none": "no connector, no prefix cache",
    "prefix": "vLLM prefix cache only",
    "kvdisk": "kvdisk",
    "example": "ExampleConnector (in-tree disk)",
    "native": "native offloading (host memory)",
}
# The CPU build's `vllm` console script is broken (it asks for a distribution named
# "vllm"); serve.py's workaround, then vLLM's own CLI.
LAUNCH_VLLM = ("import sys; from vllm_kvdisk.serve import _patch_cpu_build_version; "
               "_patch_cpu_build_version(); from vllm.entrypoints.cli.main import main; "
               "sys.argv = ['vllm', 'serve', *sys.argv[1:]]; main()")
ALIGN, MIN_TOKENS = 256, 128

TOOLS = [
    ("read_file", ("Read a text file from the workspace and return its contents with line "
     "numbers. Large files are truncated; use offset and limit to page through them."),
     {"path": "string", "offset": "integer", "limit": "integer"}),
    ("write_file", ("Create or overwrite a file in the workspace with the given content. "
     "Parent directories are created as needed."), {"path": "string", "content": "string"}),
    ("apply_patch", ("Apply a unified diff to files in the workspace. Fails without changing "
     "anything if a hunk does not apply cleanly."), {"patch": "string"}),
    ("run_shell", ("Run a shell command in the workspace and return its exit status, "
     "standard output and standard error, truncated to the last 20000 characters."),
     {"command": "string", "timeout_s": "integer"}),
    ("grep", ("Search files under a directory for a regular expression and return matching "
     "lines with file names and line numbers."),
     {"pattern": "string", "path": "string", "glob": "string"}),
    ("list_dir", ("List the entries of a directory, with sizes and types, recursively up to "
     "the given depth."), {"path": "string", "depth": "integer"}),
    ("run_tests", ("Run the project's test suite or a subset of it and return the summary and "
     "the output of failing tests."), {"selector": "string", "verbose": "boolean"}),
    ("search_docs", ("Search the documentation index of the project's dependencies and return "
     "the best matching passages with their source."), {"query": "string", "top_k": "integer"}),
]


# ---------------------------------------------------------------------------- workload
def corpus() -> str:
    """Python standard-library sources (the tiny tokenizer was trained on the same)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))]
    return "\n".join(parts)


class Workload:
    """Deterministic texts for every session and turn; identical for every configuration."""

    def __init__(self, tokenizer, args):
        self.tok = tokenizer
        self.text = corpus()
        rng = np.random.default_rng(args.seed)
        self.system = ("You are a careful software engineering agent working in a git "
                       "repository. Think step by step, call one tool at a time, read "
                       "before you write, and keep answers short.\n\n# Project notes\n"
                       + self.snippet(args.system_tokens, rng))
        self.system += "\n\n# Tools\n\n" + self.tool_block(args.tools_tokens, rng)
        self.tasks = [f"[session {s}] Task: the project at /work/project-{s} has a failing "
                      "test. Find the cause and fix it. Context from the issue:\n"
                      + self.snippet(args.task_tokens, rng) for s in range(args.sessions)]
        self.results = [[None] + [
            f"Tool result (call {t}, {TOOLS[(s + t) % len(TOOLS)][0]}):\n"
            + self.snippet(args.tool_result_tokens, rng) for t in range(1, args.turns)]
            for s in range(args.sessions)]

    def tokens(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def snippet(self, n_tokens: int, rng) -> str:
        if n_tokens <= 0:
            return ""
        start = int(rng.integers(0, len(self.text) - 12 * n_tokens))
        ids = self.tok.encode(self.text[start:start + 12 * n_tokens], add_special_tokens=False)
        return self.tok.decode(ids[:n_tokens])

    def tool_block(self, n_tokens: int, rng) -> str:
        """OpenAI-style function definitions, one JSON object per line, padded with more
        (generated) tools until the block has about n_tokens tokens."""
        tools = []
        for name, desc, params in TOOLS:
            tools.append(self._tool(name, desc, params))
        i = 0
        while self.tokens("\n".join(tools)) < n_tokens:
            i += 1
            desc = " ".join(self.snippet(40, rng).split())
            tools.append(self._tool(f"project_tool_{i}", desc, {"args": "string"}))
        return ("You may call one or more functions. Function signatures are within "
                "<tools></tools> XML tags:\n<tools>\n" + "\n".join(tools) + "\n</tools>\n"
                "Answer a call with a JSON object {\"name\": ..., \"arguments\": {...}}.")

    @staticmethod
    def _tool(name: str, desc: str, params: dict[str, str]) -> str:
        schema = {"type": "object", "required": [next(iter(params))],
                  "properties": {k: {"type": v} for k, v in params.items()}}
        return json.dumps({"type": "function", "function": {
            "name": name, "description": desc, "parameters": schema}})


# ---------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name: str, model: str, port: int, cache_dir: str | None, args,
                   trace: str | None) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "agent",
              "--dtype", "float32", "--enforce-eager", "--max-model-len",
              str(args.max_model_len), "--enable-prompt-tokens-details",
              "--shutdown-timeout", "30"]
    if name == "kvdisk":
        cmd = [sys.executable, "-m", "vllm_kvdisk.serve", "serve", model, *common,
               "--kv-disk-dir", cache_dir,
               "--kv-cache-boundary-align-tokens", str(ALIGN),
               "--kv-cache-min-tokens", str(MIN_TOKENS),
               "--kv-disk-load-policy", args.kvdisk_load_policy]
        return cmd + (["--trace", trace] if trace else [])
    vllm = [sys.executable, "-c", LAUNCH_VLLM, model, *common]
    if name == "none":
        return vllm + ["--no-enable-prefix-caching"]
    if name == "prefix":
        return vllm
    if name == "example":
        cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": cache_dir}}
        return vllm + ["--kv-transfer-config", json.dumps(cfg)]
    if name == "native":
        return vllm + ["--kv-offloading-backend", "native",
                       "--kv-offloading-size", str(args.native_offload_gib)]
    raise ValueError(name)


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
    def __init__(self, cmd: list[str], log_path: str, env: dict[str, str], port: int,
                 timeout_s: float = 300):
        self.cmd, self.url, self.log_path = cmd, f"http://127.0.0.1:{port}", log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 (open while the server runs)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=str(REPO))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:"
                                   f" {error_from_log(log_path)}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout_s:.0f} s; see {log_path}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def metrics(self) -> dict[str, float]:
        """Prometheus samples (full name with labels -> value), model labels dropped."""
        out: dict[str, float] = {}
        text = requests.get(self.url + "/metrics", timeout=30).text
        for line in text.splitlines():
            if not line.startswith("vllm:") or " " not in line:
                continue
            head, value = line.rsplit(" ", 1)
            if "{" in head:
                name, labels = head[:-1].split("{", 1)
                keep = [lb for lb in labels.split(",")
                        if lb and not lb.startswith(("model_name=", "engine="))]
                head = name + ("{" + ",".join(sorted(keep)) + "}" if keep else "")
            try:
                out[head] = out.get(head, 0.0) + float(value)
            except ValueError:
                pass
        return out

    def stop(self) -> dict:
        """SIGTERM to the main process only (as Kubernetes does); the exit code and time."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # The engine and worker processes exit on their own after the main one; wait for
        # them so nothing of this server runs into the next measurement.
        deadline, lingered = time.monotonic() + 60, False
        while True:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            if time.monotonic() > deadline:
                lingered = True
                os.killpg(self.proc.pid, signal.SIGKILL)
                time.sleep(1)
                break
            time.sleep(0.2)
        if not self._log.closed:
            self._log.close()
        return {"rc": self.proc.returncode, "stop_s": round(time.perf_counter() - t0, 2),
                "killed_lingering_children": lingered}


def _tree_cpu_s(pid: int) -> float:
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


class CpuMeter:
    """Average cores busy during a phase: the server's processes, this client, and
    everything else on the machine (other people's jobs would distort the timings)."""

    def __init__(self, server_pid: int):
        import psutil

        self.pid, self._psutil = server_pid, psutil
        self.t0, self.sys0 = time.perf_counter(), self._busy()
        self.srv0, self.me0 = _tree_cpu_s(server_pid), self._me()

    def _busy(self) -> float:
        t = self._psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    @staticmethod
    def _me() -> float:
        t = os.times()
        return t.user + t.system

    def read(self) -> dict:
        wall = time.perf_counter() - self.t0
        busy = self._busy() - self.sys0
        srv = _tree_cpu_s(self.pid) - self.srv0
        me = self._me() - self.me0
        return {"wall_s": round(wall, 2), "machine_cores": round(busy / wall, 2),
                "server_cores": round(srv / wall, 2), "client_cores": round(me / wall, 2),
                "other_cores": round(max(0.0, busy - srv - me) / wall, 2)}


def engine_cores(log_path: str) -> str | None:
    """The CPU build's OpenMP binding of the engine's worker, from the latest start-up."""
    found = None
    with open(log_path, errors="replace") as fh:
        for line in fh:
            if "core ids=" in line:
                found = line.split("core ids=", 1)[1].strip()
    return found


def disk_usage(path: str | None) -> dict:
    if not path or not os.path.isdir(path):
        return {"bytes": 0, "files": 0}
    total = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
                files += 1
            except OSError:
                pass
    return {"bytes": total, "files": files}


# ---------------------------------------------------------------------------- client
def stream_chat(url: str, messages: list[dict], max_tokens: int, timeout: float) -> dict:
    body = {"model": "agent", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    with requests.post(url + "/v1/chat/completions", json=body, stream=True,
                       timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines(chunk_size=None):
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(content)
            if chunk.get("usage"):
                usage = chunk["usage"]
    total = time.perf_counter() - t0
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total,
            "reply": "".join(parts), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"),
            "completion_tokens": usage.get("completion_tokens")}


def run_phase(server: Server, wl: Workload, history: list[list[dict]], turns: range,
              config: str, phase: str, args) -> list[dict]:
    """All sessions, the given turns, `concurrency` sessions at a time."""
    lock = threading.Lock()
    records: list[dict] = []
    t_phase = time.perf_counter()

    def session(s: int) -> None:
        msgs = history[s]
        for t in turns:
            if t == 1:
                msgs[:] = [{"role": "system", "content": wl.system},
                           {"role": "user", "content": wl.tasks[s]}]
            else:
                msgs.append({"role": "user", "content": wl.results[s][t - 1]})
            rec = {"config": config, "phase": phase, "session": s, "turn": t,
                   "first_after_restart": phase == "resumed" and t == turns.start,
                   "start_s": round(time.perf_counter() - t_phase, 4)}
            try:
                out = stream_chat(server.url, msgs, args.max_tokens, args.request_timeout)
            except Exception as exc:  # noqa: BLE001 (recorded; the session stops here)
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                with lock:
                    records.append(rec)
                return
            reply = out.pop("reply")
            rec.update(out)
            rec["reply_sha1"] = hashlib.sha1(reply.encode()).hexdigest()[:12]
            msgs.append({"role": "assistant", "content": reply})
            with lock:
                records.append(rec)

    with cf.ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        list(pool.map(session, range(args.sessions)))
    return sorted(records, key=lambda r: (r["turn"], r["session"]))


def warm_up(server: Server, args) -> None:
    """One short unrelated request, so one-time start-up costs stay out of the TTFTs."""
    stream_chat(server.url, [{"role": "user", "content": "Say hello."}], 2,
                args.request_timeout)


def token_sources(before: dict, after: dict) -> dict:
    """The server's own split of prompt tokens over a phase (counters' difference)."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)
    out = {src: int(delta(f'vllm:prompt_tokens_by_source_total{{source="{src}"}}'))
           for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    for key in after:
        if key.startswith("vllm:kvdisk_") and (key.endswith(("_total", "_sum", "_count"))
                                               or "_total{" in key):
            out[key.removeprefix("vllm:")] = delta(key)
    return out


def storage_limit(cache_dir: str, phases: dict, threads: int = 4) -> dict:
    """The machine's own bandwidth on this run's checkpoint files against what the
    server's restore and save paths achieved on them (its load/save time histograms).
    Read limits: warm = page cache, every file read by `threads` threads; cold = each file
    dropped from the page cache, one sequential preadv per file. Write limit: the same
    file sizes written with writev + fsync into new files on the same file system."""
    from io_bench import CHUNK, drop_cache, raw_read, raw_write

    paths = [os.path.join(d, f) for d, _, fs in os.walk(cache_dir) for f in fs
             if f.endswith(".kv") and "quarantine" not in d]
    sizes = [os.path.getsize(p) for p in paths]
    total = sum(sizes)
    if not total:
        return {}
    buf = memoryview(np.ones(max(sizes), dtype=np.uint8))
    pool = cf.ThreadPoolExecutor(threads)

    def timed(fn, cold: bool) -> float:
        runs = []
        for _ in range(3):
            if cold:
                for p in paths:
                    drop_cache(p)
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return sorted(runs)[1]

    def read_all(threaded: bool) -> None:
        for p, n in zip(paths, sizes):
            raw_read(p, buf[:n], CHUNK if threaded else n, pool if threaded else None)

    read_all(True)
    warm = timed(lambda: read_all(True), cold=False)
    cold = timed(lambda: read_all(False), cold=True)
    scratch = os.path.join(os.path.dirname(cache_dir), "write-limit")
    os.makedirs(scratch, exist_ok=True)
    counter = iter(range(10**9))
    write = timed(lambda: [raw_write(scratch, [buf[:n]], next(counter)) for n in sizes],
                  cold=False)
    shutil.rmtree(scratch, ignore_errors=True)
    pool.shutdown()
    tok = [ph.get("tokens", {}) for ph in phases.values()]
    read_b = sum(t.get("kvdisk_bytes_read_total", 0) for t in tok)
    read_s = sum(t.get("kvdisk_load_seconds_sum", 0) for t in tok)
    wrote_b = sum(t.get("kvdisk_bytes_written_total", 0) for t in tok)
    wrote_s = sum(t.get("kvdisk_save_seconds_sum", 0) for t in tok)
    out = {"files": len(paths), "bytes": total,
           "limit_read_warm_gbps": total / warm / 1e9, "limit_read_cold_gbps": total / cold / 1e9,
           "limit_write_fsync_gbps": total / write / 1e9,
           "server_restore_bytes": read_b, "server_restore_s": read_s,
           "server_save_bytes": wrote_b, "server_save_s": wrote_s}
    if read_b and read_s:
        out["server_restore_gbps"] = read_b / read_s / 1e9
    if wrote_b and wrote_s:
        out["server_save_gbps"] = wrote_b / wrote_s / 1e9
    return out


# ---------------------------------------------------------------------------- one config
def run_config(name: str, model: str, wl: Workload, work: str, env: dict, args) -> tuple:
    cache_dir = os.path.join(work, f"cache-{name}") if name in ("kvdisk", "example") else None
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    trace = os.path.join(work, "kvdisk-trace.log") if name == "kvdisk" else None
    log = os.path.join(work, f"server-{name}.log")
    info: dict = {"label": LABELS[name], "cache_dir": cache_dir, "log": log, "phases": {}}
    records: list[dict] = []
    history: list[list[dict]] = [[] for _ in range(args.sessions)]
    half = args.turns // 2
    phases = [("warm", range(1, half + 1)), ("resumed", range(half + 1, args.turns + 1))]
    t_cfg = time.perf_counter()
    for phase, turns in phases:
        port = free_port()
        cmd = server_command(name, model, port, cache_dir, args, trace)
        info.setdefault("command", shlex.join(cmd).replace(str(port), "PORT"))
        print(f"[{name}] {phase}: starting server", flush=True)
        try:
            server = Server(cmd, log, env, port)
        except RuntimeError as exc:
            info["status"] = "failed"
            info["error"] = f"{phase} start-up: {exc}"
            print(f"[{name}] FAILED: {exc}", flush=True)
            break
        ph: dict = {"startup_s": round(server.startup_s, 2), "engine_cores": engine_cores(log)}
        recs: list[dict] = []
        try:
            warm_up(server, args)
            time.sleep(0.5)
            before = server.metrics()
            t0 = time.perf_counter()
            meter = CpuMeter(server.proc.pid)
            recs = run_phase(server, wl, history, turns, name, phase, args)
            ph["wall_s"] = round(time.perf_counter() - t0, 2)
            ph["cpu"] = meter.read()
            time.sleep(1.0)  # let the last step's stats reach /metrics
            ph["tokens"] = token_sources(before, server.metrics())
            records += recs
            errors = [r for r in recs if "error" in r]
            if errors:
                ph["errors"] = len(errors)
                if not server.alive():
                    info["error"] = f"{phase}: server died: {error_from_log(log)}"
        except Exception as exc:  # noqa: BLE001 (recorded; the next config still runs)
            info["error"] = f"{phase}: {type(exc).__name__}: {exc}"[:400]
        finally:
            ph["stop"] = server.stop()
            ph["disk_after"] = disk_usage(cache_dir)
            info["phases"][phase] = ph
        print(f"[{name}] {phase}: {len(recs)} requests, "
              f"{ph.get('wall_s', 0):.1f} s, server start {ph['startup_s']:.1f} s, "
              f"disk {ph['disk_after']['bytes'] / 1e6:.1f} MB, cores busy "
              f"{ph.get('cpu', {}).get('machine_cores', '-')} (other processes "
              f"{ph.get('cpu', {}).get('other_cores', '-')})", flush=True)
        if "error" in info:
            info["status"] = "failed"
            break
    info.setdefault("status", "ok")
    info["wall_s"] = round(time.perf_counter() - t_cfg, 1)
    info["disk"] = disk_usage(cache_dir)
    if name == "kvdisk" and info["status"] == "ok" and cache_dir:
        info["storage_limit"] = storage_limit(cache_dir, info["phases"])
    if trace and os.path.exists(trace):
        lines = pathlib.Path(trace).read_text(errors="replace").splitlines()
        words = {"hit": "KV cache: hit for", "restored": "(loaded ",
                 "device hit": "KV cache: device hit", "miss": "KV cache: miss",
                 "saved": "KV cache: saved", "evicted": "KV cache: evicted",
                 "quarantined": "KV cache: quarantined"}
        info["trace_counts"] = {k: sum(w in ln for ln in lines) for k, w in words.items()}
        info["trace_counts"]["hit"] -= info["trace_counts"]["restored"]  # 2 lines per hit
    return info, records


# ---------------------------------------------------------------------------- report
def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def summarize(configs: dict, records: list[dict], args) -> dict:
    summary: dict = {}
    for name, info in configs.items():
        ok = [r for r in records if r["config"] == name and "error" not in r]
        s: dict = {"status": info["status"], "requests": len(ok),
                   "errors": sum(1 for r in records if r["config"] == name and "error" in r)}
        for phase in ("warm", "resumed"):
            rs = [r for r in ok if r["phase"] == phase]
            tt = [r["ttft_s"] for r in rs]
            prompt = sum(r["prompt_tokens"] or 0 for r in rs)
            cached = sum(r["cached_tokens"] or 0 for r in rs)
            s[phase] = {"n": len(rs), "ttft_p50_s": pct(tt, 50), "ttft_p95_s": pct(tt, 95),
                        "prompt_tokens": prompt, "cached_tokens": cached,
                        "computed_tokens": prompt - cached,
                        "cached_fraction": cached / prompt if prompt else None}
            tok = info["phases"].get(phase, {}).get("tokens")
            if tok:
                s[phase]["server_tokens"] = {k: tok[k] for k in
                                             ("local_compute", "local_cache_hit",
                                              "external_kv_transfer")}
        first = [r["ttft_s"] for r in ok if r.get("first_after_restart")]
        s["first_after_restart"] = {"n": len(first), "ttft_p50_s": pct(first, 50),
                                    "ttft_p95_s": pct(first, 95),
                                    "cached_tokens": sum(r["cached_tokens"] or 0 for r in ok
                                                         if r.get("first_after_restart")),
                                    "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok
                                                         if r.get("first_after_restart"))}
        s["per_turn_ttft_p50_s"] = {
            t: pct([r["ttft_s"] for r in ok if r["turn"] == t], 50)
            for t in range(1, args.turns + 1)}
        s["disk"] = info.get("disk", {"bytes": 0, "files": 0})
        summary[name] = s
    # kvdisk / peer ratios (resumed phase, and its first turn after the restart)
    kv = summary.get("kvdisk")
    if kv and kv["status"] == "ok":
        ratios = {}
        for name, s in summary.items():
            if name == "kvdisk" or s["status"] != "ok":
                continue
            r = {}
            for key, a, b in (("resumed_ttft_p50", kv["resumed"]["ttft_p50_s"],
                               s["resumed"]["ttft_p50_s"]),
                              ("resumed_ttft_p95", kv["resumed"]["ttft_p95_s"],
                               s["resumed"]["ttft_p95_s"]),
                              ("first_after_restart_ttft_p50",
                               kv["first_after_restart"]["ttft_p50_s"],
                               s["first_after_restart"]["ttft_p50_s"])):
                r[key] = a / b if a and b else None
            ratios[name] = r
        summary["kvdisk_vs_peers"] = ratios
    # exactness check for free: did every config get the replies of the baseline?
    base = {(r["session"], r["turn"]): r.get("reply_sha1") for r in records
            if r["config"] == "none" and "error" not in r}
    if base:
        summary["replies_equal_to_none"] = {
            name: f"{sum(base.get((r['session'], r['turn'])) == r.get('reply_sha1') for r in records if r['config'] == name and 'error' not in r)}"
                  f"/{sum(1 for r in records if r['config'] == name and 'error' not in r)}"
            for name in configs if name != "none" and configs[name]["status"] == "ok"}
    return summary


def report(meta: dict, configs: dict, summary: dict, args) -> str:
    L: list[str] = []
    L.append("Multi-turn agent replay: " + meta["command"])
    L.append(f"HONESTY: random-weight tiny Llama ({meta['model_shape']}, fp32, "
             f"{meta['kv_bytes_per_token'] // 1024} KiB KV/token), vLLM {meta['vllm_version']} "
             f"CPU build, {meta['cpus']}-core CPU, no GPU. Absolute times do not predict GPU "
             "serving; compare configurations with each other.")
    L.append(f"workload: {args.sessions} sessions x {args.turns} turns, concurrency "
             f"{args.concurrency}, shared system prompt + tool block {meta['shared_tokens']} "
             f"tokens, task {args.task_tokens}, tool result {args.tool_result_tokens} tokens "
             f"per turn, max_tokens {args.max_tokens}; warm = turns 1..{args.turns // 2}, "
             f"then every server restarted (SIGTERM) on the same cache dir, resumed = turns "
             f"{args.turns // 2 + 1}..{args.turns}. VLLM_CPU_KVCACHE_SPACE="
             f"{args.kv_cache_space} GiB.")
    cores = sorted({ph.get("engine_cores") or "?" for c in configs.values()
                    for ph in c["phases"].values()})
    L.append(f"CPU threads: VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus} for every "
             "configuration (vLLM's CPU build otherwise reserves one more core when a KV "
             "connector is set, which changes the compute threads between configurations); "
             f"engine worker bound to core ids {' / '.join(cores)}.")
    L.append(f"kvdisk runs with a small grid for prompts of a few thousand tokens: "
             f"--kv-cache-boundary-align-tokens {ALIGN} --kv-cache-min-tokens {MIN_TOKENS} "
             f"(ds4 defaults are 2048 / 512), load policy {args.kvdisk_load_policy}.")
    L.append("TTFT = time to the first streamed content chunk; cached = usage.prompt_tokens_"
             "details.cached_tokens; dev/conn = the server's own prompt-token counters "
             "(device prefix cache / loaded by the connector).")
    L.append("")
    hdr = (f"{'config':<9} {'warm p50/p95 ms':>16} {'resumed p50/p95':>16} "
           f"{'1st after restart':>18} {'resumed cached':>15} {'computed/dev/conn (resumed)':>28} "
           f"{'disk MB':>8} {'files':>6}")
    L.append(hdr)
    L.append("-" * len(hdr))
    for name, info in configs.items():
        s = summary[name]
        if info["status"] != "ok":
            L.append(f"{name:<9} DID NOT RUN: {info.get('error', '?')}")
            continue
        w, r, f = s["warm"], s["resumed"], s["first_after_restart"]
        st = r.get("server_tokens") or {}
        split = (f"{st.get('local_compute', 0)}/{st.get('local_cache_hit', 0)}/"
                 f"{st.get('external_kv_transfer', 0)}") if st else "-"
        frac = f"{r['cached_fraction'] * 100:.0f}%" if r["cached_fraction"] is not None else "-"
        L.append(f"{name:<9} {ms(w['ttft_p50_s']) + '/' + ms(w['ttft_p95_s']):>16} "
                 f"{ms(r['ttft_p50_s']) + '/' + ms(r['ttft_p95_s']):>16} "
                 f"{ms(f['ttft_p50_s']) + ' (' + str(f['cached_tokens']) + '/' + str(f['prompt_tokens']) + ')':>18} "
                 f"{frac:>15} {split:>28} {s['disk']['bytes'] / 1e6:>8.1f} "
                 f"{s['disk']['files']:>6}")
    L.append("(1st after restart: TTFT p50 of each session's first resumed turn, and its "
             "cached/prompt tokens summed over sessions)")
    loads = []
    for name, info in configs.items():
        for phase, ph in info["phases"].items():
            if "cpu" in ph:
                loads.append((name, phase, ph["cpu"]))
    if loads:
        L.append("average cores busy per phase, server / this client / other processes: "
                 + "; ".join(f"{n} {p} {c['server_cores']}/{c['client_cores']}/"
                             f"{c['other_cores']}" for n, p, c in loads))
        worst = max(c["other_cores"] for _, _, c in loads)
        if worst > 0.25:
            L.append(f"WARNING: other processes kept up to {worst} cores busy during a phase; "
                     "timings of that phase are distorted (rerun on an idle machine)")
    L.append("")
    L.append("TTFT p50 per turn (ms); restart between turn "
             f"{args.turns // 2} and {args.turns // 2 + 1}:")
    ok = [n for n in configs if configs[n]["status"] == "ok"]
    L.append(f"{'turn':>5} " + " ".join(f"{n:>9}" for n in ok))
    for t in range(1, args.turns + 1):
        L.append(f"{t:>5} " + " ".join(f"{ms(summary[n]['per_turn_ttft_p50_s'][t]):>9}"
                                       for n in ok))
    L.append("")
    L.append("token totals (warm | resumed): prompt, cached by usage; server split "
             "computed/device/connector")
    for n in ok:
        parts = []
        for phase in ("warm", "resumed"):
            p = summary[n][phase]
            st = p.get("server_tokens") or {}
            parts.append(f"{p['prompt_tokens']} prompt, {p['cached_tokens']} cached, "
                         f"{st.get('local_compute', '-')}/{st.get('local_cache_hit', '-')}/"
                         f"{st.get('external_kv_transfer', '-')}")
        L.append(f"  {n:<8} {' | '.join(parts)}")
    if "kvdisk_vs_peers" in summary:
        L.append("")
        L.append("kvdisk / peer TTFT ratios (< 1: kvdisk faster): resumed p50, resumed p95, "
                 "first turn after restart p50")
        for n, r in summary["kvdisk_vs_peers"].items():
            vals = [f"{v:.2f}" if v else "-" for v in r.values()]
            L.append(f"  kvdisk/{n:<8} " + "  ".join(vals))
    if "replies_equal_to_none" in summary:
        L.append("")
        L.append("replies identical to the no-cache baseline (same session and turn): "
                 + ", ".join(f"{k} {v}" for k, v in summary["replies_equal_to_none"].items()))
    kvinfo = configs.get("kvdisk", {})
    lim = kvinfo.get("storage_limit")
    if lim:
        L.append("")
        L.append(f"storage limit on this run's {lim['files']} kvdisk files "
                 f"({lim['bytes'] / 1e6:.0f} MB), measured after the run: read "
                 f"{lim['limit_read_warm_gbps']:.2f} GB/s from the page cache (4 threads), "
                 f"{lim['limit_read_cold_gbps']:.2f} GB/s cold; write+fsync "
                 f"{lim['limit_write_fsync_gbps']:.2f} GB/s")
        if "server_restore_gbps" in lim:
            r = lim["server_restore_gbps"]
            L.append(f"  server restores: {lim['server_restore_bytes'] / 1e6:.0f} MB in "
                     f"{lim['server_restore_s'] * 1e3:.0f} ms = {r:.2f} GB/s -> restore/limit "
                     f"{r / lim['limit_read_warm_gbps']:.2f} (page cache), "
                     f"{r / lim['limit_read_cold_gbps']:.2f} (cold)")
        if "server_save_gbps" in lim:
            w = lim["server_save_gbps"]
            L.append(f"  server saves: {lim['server_save_bytes'] / 1e6:.0f} MB in "
                     f"{lim['server_save_s'] * 1e3:.0f} ms = {w:.2f} GB/s -> save/limit "
                     f"{w / lim['limit_write_fsync_gbps']:.2f}")
        L.append("  (server times are per load/save job while the engine computes on the same "
                 "2 cores; a job covers every file of a chain, its metadata and hit-count update)")
    if kvinfo.get("trace_counts"):
        L.append("kvdisk trace: " + ", ".join(f"{k} {v}" for k, v in
                                               kvinfo["trace_counts"].items()))
    L.append("")
    L.append("server command lines (PORT, paths as run):")
    for n, info in configs.items():
        L.append(f"  {n}: {info.get('command', '-')}")
    L.append(f"run time {meta['wall_s']:.0f} s (server start-ups included: "
             f"{meta['startup_total_s']:.0f} s)")
    return "\n".join(L)


def plots(configs: dict, summary: dict, records: list[dict], args, out: pathlib.Path) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ok = [n for n in configs if configs[n]["status"] == "ok"]
    failed = [n for n in configs if configs[n]["status"] != "ok"]
    paths = []
    fig, ax = plt.subplots(figsize=(9, 5.2))
    turns = list(range(1, args.turns + 1))
    for n in ok:
        med = [summary[n]["per_turn_ttft_p50_s"][t] for t in turns]
        p95 = [pct([r["ttft_s"] for r in records if r["config"] == n and r["turn"] == t
                    and "error" not in r], 95) for t in turns]
        line, = ax.plot(turns, [v * 1e3 if v else np.nan for v in med], marker="o",
                        label=LABELS[n])
        ax.fill_between(turns, [v * 1e3 if v else np.nan for v in med],
                        [v * 1e3 if v else np.nan for v in p95], color=line.get_color(),
                        alpha=0.12)
    ax.axvline(args.turns // 2 + 0.5, color="gray", ls="--")
    ax.text(args.turns // 2 + 0.55, ax.get_ylim()[1] * 0.95, "server restart", va="top",
            color="gray")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token, ms (line p50, band to p95)")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(turns)
    title = (f"Agent replay: {args.sessions} sessions x {args.turns} turns, concurrency "
             f"{args.concurrency}\nrandom tiny Llama on a CPU; not GPU numbers")
    if failed:
        title += f"; did not run: {', '.join(failed)}"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    p = out / "agent_replay_ttft.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(9, 5.2))
    xs, labels = [], []
    colors = {"computed": "#d62728", "device prefix cache": "#1f77b4",
              "loaded by connector": "#2ca02c", "cached (source unknown)": "#7f7f7f"}
    used = set()
    for i, n in enumerate(ok):
        for j, phase in enumerate(("warm", "resumed")):
            x = i * 3 + j
            ph = summary[n][phase]
            st = ph.get("server_tokens")
            if st:
                parts = {"computed": st["local_compute"],
                         "device prefix cache": st["local_cache_hit"],
                         "loaded by connector": st["external_kv_transfer"]}
            else:
                parts = {"computed": ph["computed_tokens"],
                         "cached (source unknown)": ph["cached_tokens"]}
            bottom = 0
            for k, v in parts.items():
                ax.bar(x, v, bottom=bottom, color=colors[k],
                       label=k if k not in used else None)
                used.add(k)
                bottom += v
            xs.append(x)
            labels.append(f"{n}\n{phase}")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("prompt tokens (all sessions)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    title = ("Prompt tokens computed vs cached, per configuration and phase\n"
             "(server counters vllm:prompt_tokens_by_source)")
    if failed:
        title += f"; did not run: {', '.join(failed)}"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    p = out / "agent_replay_tokens.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


# ---------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS),
                    help=f"comma-separated subset of {ALL_CONFIGS}")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8, help="per session; warm = first half")
    ap.add_argument("--concurrency", type=int, default=2, help="sessions in flight at once")
    ap.add_argument("--system-tokens", type=int, default=1536,
                    help="shared system prompt (project notes), before the tool block")
    ap.add_argument("--tools-tokens", type=int, default=512, help="JSON tool block, about")
    ap.add_argument("--task-tokens", type=int, default=128, help="each session's task")
    ap.add_argument("--tool-result-tokens", type=int, default=384, help="per later turn")
    ap.add_argument("--max-tokens", type=int, default=16, help="reply length")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-space", default="2", help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument("--reserved-cpus", type=int, default=1,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration (-1: vLLM's "
                         "default, which reserves one core more when any KV connector is "
                         "set: on a 2-core machine the connector configurations would then "
                         "compute on 2 cores and the others on 1)")
    ap.add_argument("--native-offload-gib", type=float, default=1.0)
    ap.add_argument("--kvdisk-load-policy", default="auto", choices=["auto", "always"])
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--work-dir", default=None,
                    help="cache dirs and server logs (default: a temp dir, removed at the end)")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw the PNGs from OUT_DIR/agent_replay.json")
    args = ap.parse_args()
    if args.replot:
        out = pathlib.Path(args.out_dir)
        data = json.loads((out / "agent_replay.json").read_text())
        run_args = argparse.Namespace(**data["meta"]["argv"])
        summary = summarize(data["configs"], data["requests"], run_args)
        for p in plots(data["configs"], summary, data["requests"], run_args, out):
            print(f"wrote {p}")
        return
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    bad = [n for n in names if n not in ALL_CONFIGS]
    if bad or args.turns < 2:
        ap.error(f"unknown configs {bad}" if bad else "--turns must be >= 2")
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    command = shlex.join(["python", "benchmarks/agent_replay.py", *sys.argv[1:]])

    work = args.work_dir or tempfile.mkdtemp(prefix="kvdisk-agent-replay-")
    os.makedirs(work, exist_ok=True)
    from transformers import AutoTokenizer

    from vllm_kvdisk.tinymodel import build_tiny_model

    shape = model_shape(args.hidden, args.layers)
    model_dir = os.path.join(tempfile.gettempdir(),
                             f"kvdisk-agent-replay-model-{args.hidden}x{args.layers}")
    model = str(build_tiny_model(model_dir, shape=shape))
    kv_per_token = kv_bytes_per_token(shape)
    tok = AutoTokenizer.from_pretrained(model)
    wl = Workload(tok, args)
    shared = wl.tokens(tok.apply_chat_template([{"role": "system", "content": wl.system}],
                                               tokenize=False))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_space)
    if args.reserved_cpus >= 0:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    try:
        vllm_version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        vllm_version = md.version("vllm")
    print(f"model {shape} at {model}; shared prefix {shared} tokens; work dir {work}",
          flush=True)

    configs: dict = {}
    records: list[dict] = []
    try:
        for name in names:
            info, recs = run_config(name, model, wl, work, env, args)
            configs[name] = info
            records += recs
    finally:
        meta = {"command": command, "argv": vars(args), "model_shape": shape,
                "kv_bytes_per_token": kv_per_token, "shared_tokens": shared,
                "vllm_version": vllm_version, "cpus": os.cpu_count(),
                "python": platform.python_version(), "machine": platform.machine(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "wall_s": time.perf_counter() - t_start,
                "startup_total_s": sum(ph.get("startup_s", 0) for c in configs.values()
                                       for ph in c["phases"].values())}
        summary = summarize(configs, records, args) if configs else {}
        text = report(meta, configs, summary, args) if configs else "no configuration ran"
        print("\n" + text, flush=True)
        (out / "agent_replay.txt").write_text(text + "\n")
        with open(out / "agent_replay.json", "w") as fh:
            json.dump({"meta": meta, "configs": configs, "summary": summary,
                       "requests": records}, fh, indent=1, default=str)
        if configs:
            for p in plots(configs, summary, records, args, out):
                print(f"wrote {p}")
        print(f"wrote {out / 'agent_replay.json'} and {out / 'agent_replay.txt'}")
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
