"""What the client received: the sampled token ids and the tool calls of a response, seen
beside each other as the response passes (streamed or not). Used by
:mod:`vllm_kvdisk.replay.plugin`; no vLLM import (outputs are duck-typed).

* :class:`Tap` wraps the engine's output generator and keeps each choice's token ids.
* :func:`capture_stream` passes an SSE stream through unchanged and, before ``[DONE]``,
  hands each choice's tool calls (ids, names, concatenated argument deltas) with its token
  ids to ``remember``. Bad chunks are skipped; nothing here can fail the response.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.replay.messages import Signature, make_signature

log = get_logger(__name__)


class Remembers(Protocol):
    def remember(
        self,
        token_ids: list[int],
        ids: list[str],
        signature: Signature,
        tenant: str,
        prompt_ids: list[int] | None,
    ) -> None: ...


class Tap:
    """Passes the engine's outputs through and keeps each choice's sampled token ids and
    the prompt's token ids (what the turn was sampled after), for a request of
    ``tenant``."""

    def __init__(self, source: Any, *, delta: bool, tenant: str = ""):
        self._source = source
        self._delta = delta
        self.tenant = tenant
        self.prompt: list[int] | None = None
        self.tokens: dict[int, list[int]] = {}

    def __aiter__(self) -> Tap:
        return self

    async def __anext__(self) -> Any:
        out = await self._source.__anext__()
        if self.prompt is None and getattr(out, "prompt_token_ids", None):
            self.prompt = list(out.prompt_token_ids)
        for output in getattr(out, "outputs", None) or []:
            ids = list(output.token_ids or [])
            if self._delta:
                self.tokens.setdefault(output.index, []).extend(ids)
            else:
                self.tokens[output.index] = ids
        return out

    async def aclose(self) -> None:
        close = getattr(self._source, "aclose", None)
        if close is not None:
            await close()


async def capture_stream(replayer: Remembers, stream: Any, tap: Tap):
    """Yields the SSE stream unchanged; before ``[DONE]`` remembers each choice's tool calls
    as the client received them (ids, names, concatenated argument deltas)."""
    choices: dict[int, dict[str, Any]] = {}
    try:
        async for chunk in stream:
            if isinstance(chunk, str) and chunk.startswith("data: "):
                body = chunk[6:].strip()
                if body == "[DONE]":
                    _remember_stream(replayer, choices, tap)
                else:
                    _accumulate(choices, body)
            yield chunk
    finally:
        await stream.aclose()


def _accumulate(choices: dict[int, dict[str, Any]], body: str) -> None:
    try:
        data = json.loads(body)
    except ValueError:
        return
    for choice in data.get("choices") or []:
        delta = choice.get("delta") or {}
        state = choices.setdefault(
            choice.get("index", 0), {"content": [], "reasoning": [], "calls": {}}
        )
        if delta.get("content"):
            state["content"].append(delta["content"])
        for key in ("reasoning", "reasoning_content"):
            if delta.get(key):
                state["reasoning"].append(delta[key])
        for tc in delta.get("tool_calls") or []:
            call = state["calls"].setdefault(
                tc.get("index", 0), {"id": None, "name": "", "args": []}
            )
            call["id"] = call["id"] or tc.get("id")
            fn = tc.get("function") or {}
            call["name"] = call["name"] or fn.get("name") or ""
            if fn.get("arguments"):
                call["args"].append(fn["arguments"])


def _remember_stream(replayer: Remembers, choices: dict[int, dict[str, Any]], tap: Tap) -> None:
    try:
        for index, state in choices.items():
            calls = [state["calls"][k] for k in sorted(state["calls"])]
            if not calls or not all(c["id"] for c in calls):
                continue
            signature = make_signature(
                "".join(state["content"]),
                [(c["name"], "".join(c["args"])) for c in calls],
                "".join(state["reasoning"]),
            )
            replayer.remember(
                tap.tokens.get(index, []),
                [c["id"] for c in calls],
                signature,
                tap.tenant,
                tap.prompt,
            )
    except Exception:  # noqa: BLE001
        log.exception("kvdisk replay: could not record a streamed response")
