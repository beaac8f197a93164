"""Summary, table and plots of an ``agent_replay.py`` run, from its JSON alone.

    .venv/bin/python benchmarks/agent_report.py [benchmarks/results/agent_replay.json]

The headline is ``cached / ideal``: of the tokens the server had already computed once
(each request's ideal, see ``agent_workload.Ideal``), how many came back from a cache
instead of being prefilled again; per phase and for the first turn after the restart.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _tokens(rs: list[dict]) -> dict:
    prompt = sum(r["prompt_tokens"] or 0 for r in rs)
    cached = sum(r["cached_tokens"] or 0 for r in rs)
    ideal = sum(r.get("ideal_tokens") or 0 for r in rs)
    tt = [r["ttft_s"] for r in rs]
    return {
        "n": len(rs),
        "ttft_p50_s": pct(tt, 50),
        "ttft_p95_s": pct(tt, 95),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ideal_tokens": ideal,
        "cached_of_ideal": cached / ideal if ideal else None,
        "cached_fraction": cached / prompt if prompt else None,
    }


def summarize(data: dict) -> dict:
    configs, records, turns = data["configs"], data["requests"], data["meta"]["argv"]["turns"]
    summary: dict = {}
    for name, info in configs.items():
        ok = [r for r in records if r["config"] == name and "error" not in r]
        s: dict = {
            "status": info["status"],
            "requests": len(ok),
            "errors": sum(1 for r in records if r["config"] == name and "error" in r),
        }
        for phase in ("warm", "resumed"):
            s[phase] = _tokens([r for r in ok if r["phase"] == phase])
            tok = info["phases"].get(phase, {}).get("tokens")
            if tok:
                s[phase]["server_tokens"] = {
                    k: tok[k] for k in ("local_compute", "local_cache_hit", "external_kv_transfer")
                }
        s["first_after_restart"] = _tokens([r for r in ok if r.get("first_after_restart")])
        s["warm_turns_1_3"] = _tokens([r for r in ok if r["phase"] == "warm" and r["turn"] <= 3])
        s["per_turn_ttft_p50_s"] = {
            str(t): pct([r["ttft_s"] for r in ok if r["turn"] == t], 50)
            for t in range(1, turns + 1)
        }
        s["disk"] = info.get("disk", {"bytes": 0, "files": 0})
        summary[name] = s
    kv = summary.get("kvdisk")
    if kv and kv["status"] == "ok":
        ratios = {}
        for name, s in summary.items():
            if name == "kvdisk" or s["status"] != "ok":
                continue
            pairs = (
                ("warm_turns_1_3_ttft_p50", "warm_turns_1_3", "ttft_p50_s"),
                ("resumed_ttft_p50", "resumed", "ttft_p50_s"),
                ("resumed_ttft_p95", "resumed", "ttft_p95_s"),
                ("first_after_restart_ttft_p50", "first_after_restart", "ttft_p50_s"),
            )
            ratios[name] = {
                key: (kv[a][b] / s[a][b]) if kv[a][b] and s[a][b] else None for key, a, b in pairs
            }
        summary["kvdisk_vs_peers"] = ratios
    sampled = bool(data["meta"]["argv"].get("temperature"))
    base = (
        {}
        if sampled
        else {
            (r["session"], r["turn"]): r.get("reply_sha1")
            for r in records
            if r["config"] == "none" and "error" not in r
        }
    )
    if base:
        summary["replies_equal_to_none"] = {}
        for name in configs:
            if name == "none" or configs[name]["status"] != "ok":
                continue
            mine = [r for r in records if r["config"] == name and "error" not in r]
            same = sum(base.get((r["session"], r["turn"])) == r.get("reply_sha1") for r in mine)
            summary["replies_equal_to_none"][name] = f"{same}/{len(mine)}"
    return summary


def render(data: dict) -> str:
    meta, configs, args = data["meta"], data["configs"], data["meta"]["argv"]
    summary = summarize(data)
    model = meta["model"]
    L = [
        "Multi-turn agent replay: " + meta["command"],
        f"model: {model['name']} {model['shape']}, {args.get('dtype', 'float32')}, "
        f"{model['kv_bytes_per_token'] // 1024} "
        f"KiB KV/token; vLLM {meta['vllm_version']} CPU build, {meta['cpus']}-core CPU, no "
        f"GPU, KV block {meta['block_size']}. Absolute times do not predict GPU serving; "
        "compare configurations with each other.",
        f"workload: {args['sessions']} sessions x {args['turns']} turns, concurrency "
        f"{args['concurrency']}, shared system prompt + tool block {meta['shared_tokens']} "
        f"tokens, task {args['task_tokens']} (sessions 1.. repeat half of session 0's), tool "
        f"result {args['tool_result_tokens']} tokens per turn on average (0.5..1.5x), "
        f"max_tokens {args['max_tokens']}, "
        + (f"sampled at temperature {args['temperature']}" if args.get("temperature") else "greedy")
        + f"; warm = turns 1..{args['turns'] // 2}, then every "
        "server restarted (SIGTERM) on the same cache dir (prefix-warm: never), resumed = "
        "the rest.",
        "ideal = per request, the longest prefix of its prompt the server had computed "
        "once (earlier prompt + generated ids), floored to the block; cached/ideal 1.00 is "
        "a perfect cache. TTFT = time to the first streamed content chunk.",
        "",
    ]
    hdr = (
        f"{'config':<12} {'warm p50/p95 ms':>16} {'resumed p50/p95':>16} "
        f"{'1st after restart':>18} {'cached/ideal warm':>18} {'resumed':>8} "
        f"{'1st after':>10} {'disk MB':>8} {'files':>6}"
    )
    L += [hdr, "-" * len(hdr)]
    for name, info in configs.items():
        s = summary[name]
        if info["status"] != "ok":
            L.append(f"{name:<12} DID NOT RUN: {info.get('error', '?')}")
            continue
        w, r, f = s["warm"], s["resumed"], s["first_after_restart"]

        def frac(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        L.append(
            f"{name:<12} {ms(w['ttft_p50_s']) + '/' + ms(w['ttft_p95_s']):>16} "
            f"{ms(r['ttft_p50_s']) + '/' + ms(r['ttft_p95_s']):>16} "
            f"{ms(f['ttft_p50_s']):>18} {frac(w['cached_of_ideal']):>18} "
            f"{frac(r['cached_of_ideal']):>8} {frac(f['cached_of_ideal']):>10} "
            f"{s['disk']['bytes'] / 1e6:>8.1f} {s['disk']['files']:>6}"
        )
    L.append("")
    L.append("tokens (warm | resumed | first turn after the restart): cached / ideal / prompt")
    ok = [n for n in configs if configs[n]["status"] == "ok"]
    for n in ok:
        parts = [
            f"{summary[n][k]['cached_tokens']}/{summary[n][k]['ideal_tokens']}/"
            f"{summary[n][k]['prompt_tokens']}"
            for k in ("warm", "resumed", "first_after_restart")
        ]
        L.append(f"  {n:<12} " + " | ".join(parts))
    loads = [
        (n, p, ph["cpu"])
        for n, info in configs.items()
        for p, ph in info["phases"].items()
        if "cpu" in ph
    ]
    if loads:
        L.append(
            "average cores busy per phase, server / client / other processes: "
            + "; ".join(
                f"{n} {p} {c['server_cores']}/{c['client_cores']}/{c['other_cores']}"
                for n, p, c in loads
            )
        )
        worst = max(c["other_cores"] for _, _, c in loads)
        if worst > 0.25:
            L.append(
                f"WARNING: other processes kept up to {worst} cores busy during a phase; "
                "its timings are distorted"
            )
    L.append("")
    L.append(
        f"TTFT p50 per turn (ms); restart between turn {args['turns'] // 2} and "
        f"{args['turns'] // 2 + 1}:"
    )
    L.append(f"{'turn':>5} " + " ".join(f"{n:>12}" for n in ok))
    for t in range(1, args["turns"] + 1):
        L.append(
            f"{t:>5} "
            + " ".join(f"{ms(summary[n]['per_turn_ttft_p50_s'][str(t)]):>12}" for n in ok)
        )
    if "kvdisk_vs_peers" in summary:
        L.append("")
        L.append(
            "kvdisk / peer TTFT (< 1: kvdisk faster): warm turns 1-3 p50 (target vs "
            "prefix <= 1.05), resumed p50, resumed p95, first turn after restart p50"
        )
        for n, r in summary["kvdisk_vs_peers"].items():
            L.append(f"  kvdisk/{n:<12} " + "  ".join(f"{v:.2f}" if v else "-" for v in r.values()))
    if "replies_equal_to_none" in summary:
        L.append("")
        L.append(
            "replies identical to the no-cache baseline (same session and turn): "
            + ", ".join(f"{k} {v}" for k, v in summary["replies_equal_to_none"].items())
        )
    per_token = data["meta"]["model"].get("kv_bytes_per_token") if "meta" in data else None
    for n in ok:
        info = configs[n]
        if per_token and info.get("unique_blocks") and "bytes_written" in info:
            unique = info["unique_blocks"] * data["meta"]["block_size"] * per_token
            L.append(
                f"{n}: written / unique KV {info['bytes_written'] / unique:.2f}, on disk / "
                f"unique KV {info['disk']['bytes'] / unique:.2f} (unique: the distinct "
                f"blocks the server computed, {unique / 1e6:.0f} MB)"
            )
    lim = configs.get("kvdisk", {}).get("storage_limit")
    if lim:
        L.append("")
        L.append(
            f"storage limit on this run's {lim['files']} kvdisk files "
            f"({lim['bytes'] / 1e6:.0f} MB), measured after the run: read "
            f"{lim['limit_read_warm_gbps']:.2f} GB/s page cache (4 threads), "
            f"{lim['limit_read_cold_gbps']:.2f} GB/s cold; write+fsync "
            f"{lim['limit_write_fsync_gbps']:.2f} GB/s"
        )
        if "server_restore_gbps" in lim:
            r = lim["server_restore_gbps"]
            L.append(
                f"  server restores: {lim['server_restore_bytes'] / 1e6:.0f} MB in "
                f"{lim['server_restore_s'] * 1e3:.0f} ms = {r:.2f} GB/s -> restore/limit "
                f"{r / lim['limit_read_warm_gbps']:.2f} (page cache), "
                f"{r / lim['limit_read_cold_gbps']:.2f} (cold)"
            )
        if "server_save_gbps" in lim:
            w = lim["server_save_gbps"]
            L.append(
                f"  server saves: {lim['server_save_bytes'] / 1e6:.0f} MB in "
                f"{lim['server_save_s'] * 1e3:.0f} ms = {w:.2f} GB/s -> save/limit "
                f"{w / lim['limit_write_fsync_gbps']:.2f}"
            )
    for n in ok:
        counts = configs[n].get("trace_counts")
        if counts:
            L.append(f"{n} trace: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    L.append("")
    L.append("server command lines (PORT, paths as run):")
    for n, info in configs.items():
        L.append(f"  {n}: {info.get('command', '-')}")
    L.append(f"run time {meta['wall_s']:.0f} s (server start-ups: {meta['startup_total_s']:.0f} s)")
    return "\n".join(L)


def plots(data: dict, out: pathlib.Path, suffix: str = "") -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    configs, records, args = data["configs"], data["requests"], data["meta"]["argv"]
    summary = summarize(data)
    ok = [n for n in configs if configs[n]["status"] == "ok"]
    turns = list(range(1, args["turns"] + 1))
    paths = []
    fig, ax = plt.subplots(figsize=(9, 5.2))
    for n in ok:
        med = [summary[n]["per_turn_ttft_p50_s"][str(t)] for t in turns]
        ax.plot(
            turns, [v * 1e3 if v else np.nan for v in med], marker="o", label=configs[n]["label"]
        )
    ax.axvline(args["turns"] // 2 + 0.5, color="gray", ls="--")
    ax.set_xlabel("turn (server restart at the dashed line)")
    ax.set_ylabel("time to first token, p50 over sessions, ms")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xticks(turns)
    ax.set_title(
        f"Agent replay, {data['meta']['model']['name']}: {args['sessions']} sessions "
        f"x {args['turns']} turns on a CPU (not GPU numbers)",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    paths.append(out / f"agent_replay{suffix}_ttft.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5.2))
    width = 0.8 / max(1, len(ok))
    for i, n in enumerate(ok):
        vals = []
        for t in turns:
            rs = [r for r in records if r["config"] == n and r["turn"] == t and "error" not in r]
            ideal = sum(r.get("ideal_tokens") or 0 for r in rs)
            vals.append(sum(r["cached_tokens"] or 0 for r in rs) / ideal if ideal else np.nan)
        ax.bar(
            [t + (i - len(ok) / 2 + 0.5) * width for t in turns],
            vals,
            width,
            label=configs[n]["label"],
        )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axvline(args["turns"] // 2 + 0.5, color="gray", ls="--")
    ax.set_xticks(turns)
    ax.set_xlabel("turn")
    ax.set_ylabel("cached / ideal prompt tokens")
    ax.set_title("Share of the already-computed prefix served from a cache, per turn", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    paths.append(out / f"agent_replay{suffix}_ideal.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_outputs(data: dict, out: pathlib.Path, suffix: str = "") -> list[pathlib.Path]:
    text_path = out / f"agent_replay{suffix}.txt"
    text_path.write_text(render(data) + "\n")
    written = [text_path]
    try:
        written += plots(data, out, suffix)
    except ImportError:
        pass  # matplotlib is in the bench extra
    return written


def main() -> None:
    path = pathlib.Path(
        sys.argv[1]
        if len(sys.argv) > 1
        else pathlib.Path(__file__).parent / "results" / "agent_replay.json"
    )
    data = json.loads(path.read_text())
    suffix = path.stem.removeprefix("agent_replay")
    print(render(data))
    for written in write_outputs(data, path.parent, suffix):
        print(f"wrote {written}")


if __name__ == "__main__":
    main()
