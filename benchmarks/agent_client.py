"""agent_replay's client: streamed chat completions with ``return_token_ids``, one phase of
the workload (sessions in parallel, turns in order), each request's TTFT and token counts
against the ideal."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import threading
import time

import requests
from agent_workload import Ideal, Workload

from vllm_kvdisk.testing import harness


def stream_chat(
    url: str,
    messages: list[dict],
    max_tokens: int,
    timeout: float,
    temperature: float = 0.0,
    seed: int | None = None,
) -> dict:
    body = {
        "model": "agent",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if seed is not None:
        body["seed"] = seed
    t0 = time.perf_counter()
    ttft, parts, usage, prompt_ids, generated = None, [], None, None, []
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=timeout) as r:
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
    return {
        "ttft_s": ttft if ttft is not None else total,
        "total_s": total,
        "reply": "".join(parts),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "prompt_ids": prompt_ids or [],
        "generated_ids": generated,
    }


def run_phase(
    server: harness.Server,
    wl: Workload,
    ideal: Ideal,
    history: list[list[dict]],
    turns: range,
    config: str,
    phase: str,
    args,
) -> list[dict]:
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
            rec = {
                "config": config,
                "phase": phase,
                "session": s,
                "turn": t,
                "first_after_restart": phase == "resumed" and t == turns.start,
                "start_s": round(time.perf_counter() - t_phase, 4),
            }
            try:
                out = stream_chat(
                    server.url, msgs, args.max_tokens, args.request_timeout, args.temperature
                )
            except Exception as exc:  # noqa: BLE001 (recorded; the session stops here)
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
                with lock:
                    records.append(rec)
                first_done.set()
                return
            reply, prompt_ids, generated = (
                out.pop("reply"),
                out.pop("prompt_ids"),
                out.pop("generated_ids"),
            )
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
