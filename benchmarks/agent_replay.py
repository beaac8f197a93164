"""Multi-turn agent replay against real servers, in every cache configuration, one run.

    .venv/bin/python benchmarks/agent_replay.py [--model tiny|smollm2|PATH] [--sessions 4] [--turns 8]

Drives the workload of ``agent_workload.py`` (N sessions x M turns, concurrency C) as
streamed chat completions (``return_token_ids``) against an OpenAI-compatible server on
127.0.0.1. Per configuration: warm phase (turns 1..M/2), server restart (SIGTERM to the
main process, a new server on the same cache directory), resumed phase (the other turns).
Configurations (their command lines go into the output):
  none         plain vLLM, --no-enable-prefix-caching
  prefix       plain vLLM, its prefix cache only (the default)
  kvdisk       vllm-kvdisk serve, ds4's default grid (2048/32) with tail checkpoints
  kvdisk-grid  the same with --no-kv-cache-tail-checkpoints: exactly ds4's positions
  example      plain vLLM + the in-tree ExampleConnector (shared_storage_path=DIR)
  native       plain vLLM --kv-offloading-backend native (host memory); a configuration
               whose server does not start is recorded with its error.
Per request: TTFT, prompt / cached tokens (usage), and the *ideal*: the longest prefix
the server had computed once (agent_workload.Ideal). Per phase: the server's own prompt
token counters. Writes OUT/agent_replay[-MODEL].json; ``agent_report.py`` turns it into
the table (also printed here) and the plots.

On a small CPU box absolute times say little about GPU serving: compare configurations.
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
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import requests
from agent_report import render, write_outputs
from agent_workload import Ideal, Workload
from common import kv_bytes_per_token, model_shape

from vllm_kvdisk.ops import trace
from vllm_kvdisk.testing import harness

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
ALL_CONFIGS = ["none", "prefix", "kvdisk", "kvdisk-grid", "example", "native"]
LABELS = {
    "none": "no connector, no prefix cache",
    "prefix": "vLLM prefix cache only",
    "kvdisk": "kvdisk (grid + tails)",
    "kvdisk-grid": "kvdisk, ds4 grid only",
    "example": "ExampleConnector (in-tree disk)",
    "native": "native offloading (host memory)",
}


def server_command(name: str, model: str, port: int, cache_dir: str | None, args,
                   trace_path: str | None) -> list[str]:
    common = ["--served-model-name", "agent", "--dtype", "float32", "--enforce-eager",
              "--max-model-len", str(args.max_model_len), "--enable-prompt-tokens-details",
              "--shutdown-timeout", "30"]
    if name.startswith("kvdisk"):
        extra = ["--kv-disk-load-policy", args.kvdisk_load_policy]
        if name == "kvdisk-grid":
            extra.append("--no-kv-cache-tail-checkpoints")
        if trace_path:
            extra += ["--trace", trace_path]
        return harness.kvdisk_command(model, cache_dir, port, *common, *extra)
    if name == "none":
        return harness.vllm_command(model, port, *common, "--no-enable-prefix-caching")
    if name == "prefix":
        return harness.vllm_command(model, port, *common)
    if name == "example":
        cfg = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": cache_dir}}
        return harness.vllm_command(model, port, *common, "--kv-transfer-config", json.dumps(cfg))
    if name == "native":
        return harness.vllm_command(model, port, *common, "--kv-offloading-backend", "native",
                                    "--kv-offloading-size", str(args.native_offload_gib))
    raise ValueError(name)


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
    everything else on the machine (other jobs would distort the timings)."""

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


def stream_chat(url: str, messages: list[dict], max_tokens: int, timeout: float,
                temperature: float = 0.0, seed: int | None = None) -> dict:
    body = {"model": "agent", "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if seed is not None:
        body["seed"] = seed
    t0 = time.perf_counter()
    ttft, parts, usage, prompt_ids, generated = None, [], None, None, []
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
            if chunk.get("prompt_token_ids") is not None and prompt_ids is None:
                prompt_ids = chunk["prompt_token_ids"]
            for choice in chunk.get("choices") or []:
                generated += choice.get("token_ids") or []
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
            "completion_tokens": usage.get("completion_tokens"),
            "prompt_ids": prompt_ids or [], "generated_ids": generated}


def run_phase(server: harness.Server, wl: Workload, ideal: Ideal, history: list[list[dict]],
              turns: range, config: str, phase: str, args) -> list[dict]:
    """All sessions, the given turns, ``concurrency`` sessions at a time; session s waits
    for session 0's first turn (a sibling of session 0 must find its checkpoint)."""
    lock = threading.Lock()
    records: list[dict] = []
    t_phase = time.perf_counter()
    first_done = threading.Event()
    if turns.start > 1:
        first_done.set()

    def session(s: int) -> None:
        if s > 0:
            first_done.wait(args.request_timeout)
        for t in turns:
            msgs = wl.messages(history[s], s, t)
            rec = {"config": config, "phase": phase, "session": s, "turn": t,
                   "first_after_restart": phase == "resumed" and t == turns.start,
                   "start_s": round(time.perf_counter() - t_phase, 4)}
            try:
                out = stream_chat(server.url, msgs, args.max_tokens, args.request_timeout,
                                  args.temperature)
            except Exception as exc:  # noqa: BLE001 (recorded; the session stops here)
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                with lock:
                    records.append(rec)
                first_done.set()
                return
            reply, prompt_ids, generated = out.pop("reply"), out.pop("prompt_ids"), out.pop("generated_ids")
            with lock:
                rec["ideal_tokens"] = ideal.of(prompt_ids)  # computed before this request ended
                ideal.add(prompt_ids, generated)
            rec.update(out)
            rec["reply_sha1"] = hashlib.sha1(reply.encode()).hexdigest()[:12]
            history[s] = msgs + [{"role": "assistant", "content": reply}]
            with lock:
                records.append(rec)
            if s == 0 and t == 1:
                first_done.set()

    with cf.ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        list(pool.map(session, range(args.sessions)))
    return sorted(records, key=lambda r: (r["turn"], r["session"]))


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
    server's restore and save paths achieved on them (its load/save histograms)."""
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


def run_config(name: str, model: str, wl: Workload, block: int, work: str, env: dict,
               args) -> tuple[dict, list[dict]]:
    cache_dir = os.path.join(work, f"cache-{name}") if name in (
        "kvdisk", "kvdisk-grid", "example") else None
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    trace_path = os.path.join(work, f"trace-{name}.log") if name.startswith("kvdisk") else None
    log = os.path.join(work, f"server-{name}.log")
    info: dict = {"label": LABELS[name], "cache_dir": cache_dir, "log": log, "phases": {}}
    records: list[dict] = []
    history: list[list[dict]] = [[] for _ in range(args.sessions)]
    ideal = Ideal(block)
    half = args.turns // 2
    t_cfg = time.perf_counter()
    for phase, turns in (("warm", range(1, half + 1)), ("resumed", range(half + 1, args.turns + 1))):
        port = harness.free_port()
        cmd = server_command(name, model, port, cache_dir, args, trace_path)
        info.setdefault("command", shlex.join(cmd).replace(str(port), "PORT"))
        print(f"[{name}] {phase}: starting server", flush=True)
        try:
            server = harness.Server(cmd, log, port, env=env, cwd=str(REPO))
        except RuntimeError as exc:
            info["status"], info["error"] = "failed", f"{phase} start-up: {exc}"
            print(f"[{name}] FAILED: {exc}", flush=True)
            break
        ph: dict = {"startup_s": round(server.startup_s, 2), "engine_cores": engine_cores(log)}
        recs: list[dict] = []
        try:
            stream_chat(server.url, [{"role": "user", "content": "Say hello."}], 2,
                        args.request_timeout)  # one-time start-up costs stay out of TTFTs
            time.sleep(0.5)
            before = server.metrics()
            t0 = time.perf_counter()
            meter = CpuMeter(server.proc.pid)
            recs = run_phase(server, wl, ideal, history, turns, name, phase, args)
            ph["wall_s"] = round(time.perf_counter() - t0, 2)
            ph["cpu"] = meter.read()
            time.sleep(1.0)  # let the last step's stats reach /metrics
            ph["tokens"] = token_sources(before, server.metrics())
            records += recs
            errors = [r for r in recs if "error" in r]
            if errors:
                ph["errors"] = len(errors)
                if not server.alive():
                    info["error"] = f"{phase}: server died: {harness.error_from_log(log)}"
        except Exception as exc:  # noqa: BLE001 (recorded; the next config still runs)
            info["error"] = f"{phase}: {type(exc).__name__}: {exc}"[:400]
        finally:
            ph["stop"] = server.stop()
            ph["disk_after"] = disk_usage(cache_dir)
            info["phases"][phase] = ph
        print(f"[{name}] {phase}: {len(recs)} requests, {ph.get('wall_s', 0):.1f} s, server "
              f"start {ph['startup_s']:.1f} s, disk {ph['disk_after']['bytes'] / 1e6:.1f} MB, "
              f"cores busy {ph.get('cpu', {}).get('machine_cores', '-')} (other processes "
              f"{ph.get('cpu', {}).get('other_cores', '-')})", flush=True)
        if "error" in info:
            info["status"] = "failed"
            break
    info.setdefault("status", "ok")
    info["wall_s"] = round(time.perf_counter() - t_cfg, 1)
    info["disk"] = disk_usage(cache_dir)
    if name == "kvdisk" and info["status"] == "ok" and cache_dir:
        info["storage_limit"] = storage_limit(cache_dir, info["phases"])
    if trace_path and os.path.exists(trace_path):
        counts: dict[str, int] = {}
        for event in trace.read(trace_path):
            counts[event.kind] = counts.get(event.kind, 0) + 1
        info["trace_counts"] = counts
    return info, records


def prepare_model(args) -> tuple[str, dict]:
    """The model to serve and what to say about it."""
    if args.model == "tiny":
        from vllm_kvdisk.testing.tinymodel import build_tiny_model

        shape = model_shape(args.hidden, args.layers)
        model_dir = os.path.join(tempfile.gettempdir(),
                                 f"kvdisk-agent-replay-model-{args.hidden}x{args.layers}")
        return str(build_tiny_model(model_dir, shape=shape)), {
            "name": "random tiny Llama", "shape": shape, "kv_bytes_per_token": kv_bytes_per_token(shape)}
    path = args.model
    if args.model == "smollm2":
        path = subprocess.run([sys.executable, str(REPO / "benchmarks" / "prepare_smollm2.py")],
                              check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    cfg = json.loads(pathlib.Path(path, "config.json").read_text())
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return path, {"name": os.path.basename(path.rstrip("/")), "shape": {
        "layers": cfg["num_hidden_layers"], "kv_heads": kv_heads, "head_dim": head},
        "kv_bytes_per_token": 2 * cfg["num_hidden_layers"] * kv_heads * head * 4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (random, built offline), smollm2 "
                    "(SmolLM2-135M-Instruct, benchmarks/prepare_smollm2.py) or a model path")
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS),
                    help=f"comma-separated subset of {ALL_CONFIGS}")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8, help="per session; warm = first half")
    ap.add_argument("--concurrency", type=int, default=2, help="sessions in flight at once")
    ap.add_argument("--system-tokens", type=int, default=1536,
                    help="shared system prompt (project notes), before the tool block")
    ap.add_argument("--tools-tokens", type=int, default=512, help="JSON tool block, about")
    ap.add_argument("--task-tokens", type=int, default=256, help="each session's task")
    ap.add_argument("--tool-result-tokens", type=int, default=384,
                    help="per later turn, on average (0.5..1.5x)")
    ap.add_argument("--max-tokens", type=int, default=32, help="reply length")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-space", default="2", help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument("--reserved-cpus", type=int, default=1,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration (-1: vLLM's "
                         "default, which reserves one core more when a KV connector is set)")
    ap.add_argument("--native-offload-gib", type=float, default=1.0)
    ap.add_argument("--kvdisk-load-policy", default="auto", choices=["auto", "always"])
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature; above 0 the conversations of two "
                         "configurations diverge, so replies are not compared (requests are "
                         "not seeded: vLLM 0.32.0's CPU build dies on per-request seeds, "
                         "'CPU Generator does not use offset')")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--work-dir", default=None,
                    help="cache dirs and server logs (default: a temp dir, removed at the end)")
    args = ap.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    bad = [n for n in names if n not in ALL_CONFIGS]
    if bad or args.turns < 2:
        ap.error(f"unknown configs {bad}" if bad else "--turns must be >= 2")
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    work = args.work_dir or tempfile.mkdtemp(prefix="kvdisk-agent-replay-")
    os.makedirs(work, exist_ok=True)
    from transformers import AutoTokenizer

    model, model_info = prepare_model(args)
    tok = AutoTokenizer.from_pretrained(model)
    wl = Workload(tok, sessions=args.sessions, turns=args.turns,
                  system_tokens=args.system_tokens, tools_tokens=args.tools_tokens,
                  task_tokens=args.task_tokens, tool_result_tokens=args.tool_result_tokens,
                  seed=args.seed)
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
    block = 128 if "cpu" in vllm_version or not os.path.exists("/dev/nvidia0") else 16
    print(f"model {model_info} at {model}; shared prefix {shared} tokens; work dir {work}",
          flush=True)
    configs: dict = {}
    records: list[dict] = []
    try:
        for name in names:
            info, recs = run_config(name, model, wl, block, work, env, args)
            configs[name] = info
            records += recs
    finally:
        meta = {"command": shlex.join(["python", "benchmarks/agent_replay.py", *sys.argv[1:]]),
                "argv": vars(args), "model": model_info, "block_size": block,
                "shared_tokens": shared, "vllm_version": vllm_version, "cpus": os.cpu_count(),
                "python": platform.python_version(), "machine": platform.machine(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "wall_s": time.perf_counter() - t_start,
                "startup_total_s": sum(ph.get("startup_s", 0) for c in configs.values()
                                       for ph in c["phases"].values())}
        data = {"meta": meta, "configs": configs, "requests": records}
        suffix = "" if args.model == "tiny" else f"-{pathlib.Path(args.model).name}"
        if args.temperature:
            suffix += f"-t{args.temperature:g}"
        path = out / f"agent_replay{suffix}.json"
        path.write_text(json.dumps(data, indent=1, default=str))
        print("\n" + render(data), flush=True)
        for written in write_outputs(data, out, suffix):
            print(f"wrote {written}")
        print(f"wrote {path}")
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
