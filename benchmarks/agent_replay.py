"""Multi-turn agent replay against real servers, in every cache configuration, one run.

    .venv/bin/python benchmarks/agent_replay.py [--model tiny|smollm2|PATH] \
        [--sessions 4] [--turns 8]

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
import time

from agent_client import run_phase, stream_chat
from agent_measure import (
    CpuMeter,
    disk_usage,
    engine_cores,
    storage_limit,
    token_sources,
    unique_blocks,
)
from agent_report import render, write_outputs
from agent_workload import Ideal, Workload
from common import kv_bytes_per_token, model_shape

from vllm_kvdisk.ops import trace
from vllm_kvdisk.testing import harness

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
ALL_CONFIGS = ["none", "prefix", "prefix-warm", "kvdisk", "kvdisk-grid", "example", "native"]
LABELS = {
    "none": "no connector, no prefix cache",
    "prefix": "vLLM prefix cache only",
    "prefix-warm": "vLLM prefix cache only, never restarted (what a warm engine keeps)",
    "kvdisk": "kvdisk (grid + tails)",
    "kvdisk-grid": "kvdisk, ds4 grid only",
    "example": "ExampleConnector (in-tree disk)",
    "native": "native offloading (host memory)",
}


def server_command(
    name: str, model: str, port: int, cache_dir: str | None, args, trace_path: str | None
) -> list[str]:
    common = [
        "--served-model-name",
        "agent",
        "--dtype",
        args.dtype,
        "--enforce-eager",
        "--max-model-len",
        str(args.max_model_len),
        "--enable-prompt-tokens-details",
        "--shutdown-timeout",
        "30",
    ]
    if name.startswith("kvdisk"):
        extra = ["--kv-disk-load-policy", args.kvdisk_load_policy]
        if name == "kvdisk-grid":
            extra.append("--no-kv-cache-tail-checkpoints")
        if trace_path:
            extra += ["--trace", trace_path]
        return harness.kvdisk_command(model, cache_dir, port, *common, *extra)
    if name == "none":
        return harness.vllm_command(model, port, *common, "--no-enable-prefix-caching")
    if name in ("prefix", "prefix-warm"):
        return harness.vllm_command(model, port, *common)
    if name == "example":
        cfg = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": cache_dir},
        }
        return harness.vllm_command(model, port, *common, "--kv-transfer-config", json.dumps(cfg))
    if name == "native":
        return harness.vllm_command(
            model,
            port,
            *common,
            "--kv-offloading-backend",
            "native",
            "--kv-offloading-size",
            str(args.native_offload_gib),
        )
    raise ValueError(name)


def run_config(
    name: str, model: str, wl: Workload, block: int, work: str, env: dict, args
) -> tuple[dict, list[dict]]:
    cache_dir = (
        os.path.join(work, f"cache-{name}")
        if name in ("kvdisk", "kvdisk-grid", "example")
        else None
    )
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
    keep = name == "prefix-warm"  # one server for both phases: the warm reference
    server = None
    for phase, turns in (
        ("warm", range(1, half + 1)),
        ("resumed", range(half + 1, args.turns + 1)),
    ):
        started = server is None
        if started:
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
        ph: dict = {
            "startup_s": round(server.startup_s, 2) if started else 0.0,
            "engine_cores": engine_cores(log),
        }
        recs: list[dict] = []
        try:
            stream_chat(
                server.url, [{"role": "user", "content": "Say hello."}], 2, args.request_timeout
            )  # one-time start-up costs stay out of TTFTs
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
            if not keep or phase == "resumed" or "error" in info:
                ph["stop"] = server.stop()
                server = None
            ph["disk_after"] = disk_usage(cache_dir)
            info["phases"][phase] = ph
        print(
            f"[{name}] {phase}: {len(recs)} requests, {ph.get('wall_s', 0):.1f} s, server "
            f"start {ph['startup_s']:.1f} s, disk {ph['disk_after']['bytes'] / 1e6:.1f} MB, "
            f"cores busy {ph.get('cpu', {}).get('machine_cores', '-')} (other processes "
            f"{ph.get('cpu', {}).get('other_cores', '-')})",
            flush=True,
        )
        if "error" in info:
            info["status"] = "failed"
            break
    info.setdefault("status", "ok")
    info["wall_s"] = round(time.perf_counter() - t_cfg, 1)
    info["disk"] = disk_usage(cache_dir)
    if name == "kvdisk" and info["status"] == "ok" and cache_dir:
        info["storage_limit"] = storage_limit(cache_dir, info["phases"])
    info["unique_blocks"] = unique_blocks(ideal.computed, block)
    if trace_path and os.path.exists(trace_path):
        counts: dict[str, int] = {}
        for event in trace.read(trace_path):
            counts[event.kind] = counts.get(event.kind, 0) + 1
            if event.kind == "saved":
                info["bytes_written"] = info.get("bytes_written", 0) + event.bytes
        info["trace_counts"] = counts
    return info, records


def prepare_model(args) -> tuple[str, dict]:
    """The model to serve and what to say about it."""
    if args.model == "tiny":
        from vllm_kvdisk.testing.tinymodel import build_tiny_model

        shape = model_shape(args.hidden, args.layers)
        model_dir = os.path.join(
            tempfile.gettempdir(), f"kvdisk-agent-replay-model-{args.hidden}x{args.layers}"
        )
        return str(build_tiny_model(model_dir, shape=shape)), {
            "name": "random tiny Llama",
            "shape": shape,
            "kv_bytes_per_token": kv_bytes_per_token(shape),
        }
    path = args.model
    if args.model == "smollm2":
        path = (
            subprocess.run(
                [sys.executable, str(REPO / "benchmarks" / "prepare_smollm2.py")],
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
    cfg = json.loads(pathlib.Path(path, "config.json").read_text())
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return path, {
        "name": os.path.basename(path.rstrip("/")),
        "shape": {"layers": cfg["num_hidden_layers"], "kv_heads": kv_heads, "head_dim": head},
        "kv_bytes_per_token": 2 * cfg["num_hidden_layers"] * kv_heads * head * 4,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="tiny",
        help="tiny (random, built offline), smollm2 "
        "(SmolLM2-135M-Instruct, benchmarks/prepare_smollm2.py) or a model path",
    )
    ap.add_argument(
        "--configs", default=",".join(ALL_CONFIGS), help=f"comma-separated subset of {ALL_CONFIGS}"
    )
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8, help="per session; warm = first half")
    ap.add_argument("--concurrency", type=int, default=2, help="sessions in flight at once")
    ap.add_argument(
        "--system-tokens",
        type=int,
        default=1536,
        help="shared system prompt (project notes), before the tool block",
    )
    ap.add_argument("--tools-tokens", type=int, default=512, help="JSON tool block, about")
    ap.add_argument("--task-tokens", type=int, default=256, help="each session's task")
    ap.add_argument(
        "--tool-result-tokens", type=int, default=384, help="per later turn, on average (0.5..1.5x)"
    )
    ap.add_argument("--max-tokens", type=int, default=32, help="reply length")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument(
        "--dtype",
        default="float32",
        help="bfloat16 for a Gated-DeltaNet model (vLLM's CPU kernel needs it)",
    )
    ap.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="the engine's KV block, for the ideal hit (0: vLLM's CPU default, "
        "128; a Mamba/GDN hybrid aligns it up, e.g. 640)",
    )
    ap.add_argument("--kv-cache-space", default="2", help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration (-1: vLLM's "
        "default, which reserves one core more when a KV connector is set)",
    )
    ap.add_argument("--native-offload-gib", type=float, default=1.0)
    ap.add_argument("--kvdisk-load-policy", default="auto", choices=["auto", "always"])
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; above 0 the conversations of two "
        "configurations diverge, so replies are not compared (requests are "
        "not seeded: vLLM 0.32.0's CPU build dies on per-request seeds, "
        "'CPU Generator does not use offset')",
    )
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument(
        "--work-dir",
        default=None,
        help="cache dirs and server logs (default: a temp dir, removed at the end)",
    )
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
    wl = Workload(
        tok,
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        tools_tokens=args.tools_tokens,
        task_tokens=args.task_tokens,
        tool_result_tokens=args.tool_result_tokens,
        seed=args.seed,
    )
    shared = wl.tokens(
        tok.apply_chat_template([{"role": "system", "content": wl.system}], tokenize=False)
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_space)
    if args.reserved_cpus >= 0:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    try:
        vllm_version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        vllm_version = md.version("vllm")
    block = args.block_size or (
        128 if "cpu" in vllm_version or not os.path.exists("/dev/nvidia0") else 16
    )
    print(
        f"model {model_info} at {model}; shared prefix {shared} tokens; work dir {work}", flush=True
    )
    configs: dict = {}
    records: list[dict] = []
    try:
        for name in names:
            info, recs = run_config(name, model, wl, block, work, env, args)
            configs[name] = info
            records += recs
    finally:
        meta = {
            "command": shlex.join(["python", "benchmarks/agent_replay.py", *sys.argv[1:]]),
            "argv": vars(args),
            "model": model_info,
            "block_size": block,
            "shared_tokens": shared,
            "vllm_version": vllm_version,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "wall_s": time.perf_counter() - t_start,
            "startup_total_s": sum(
                ph.get("startup_s", 0) for c in configs.values() for ph in c["phases"].values()
            ),
        }
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
