"""The ``kvdisk`` object of each response, in the API server: streams, and messages.

The scheduler connector returns ``{"kvdisk": {...}}`` (:mod:`vllm_kvdisk.core.report`)
from ``request_finished``; vLLM puts a connector's params in a full response as
``kv_transfer_params``, and on the final ``RequestOutput`` of a stream, but writes no
stream chunk with them. This module, installed by the API-server plugin on the app's
own handler objects (instance attributes; no vLLM class is patched):

* adds ``kv_transfer_params`` to the chunks of a chat or completions stream that finish a
  choice or carry usage, once the engine returned its params: the final chunk carries
  them (the usage chunk if the client asked for one, else the last choice's chunk); no
  chunk is added or held back;
* names the chat message a divergence falls in: ``divergence.message = {"index": i,
  "role": r}`` (``role`` ``tools`` and ``index`` null when it falls in the rendered tool
  definitions). The engine sees only token ids; the byte offset it found is in the
  prompt's rendered text, which the API server rendered from the messages. Rendering
  prefixes of the same messages with the same renderer and parameters says exactly
  where each message ends: a binary search over the message count (about log2(n)
  renders, plus two for the tools), done only for a response that reports a
  divergence, after the engine finished it, and given up after ``LOCATE_BUDGET_S``.

Nothing here can fail a response: any error leaves the object as the engine wrote it.
No vLLM import (requests, outputs and the renderer are duck-typed).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.core.report import REPORT_KEY

log = get_logger(__name__)

PARAMS_KEY = "kv_transfer_params"
# The most a response waits for its divergence to be placed in a message (renders of
# very long conversations): past it, the object goes out without ``message``.
LOCATE_BUDGET_S = 0.25
_FINAL = re.compile(r'"finish_reason":\s*"|"usage":\s*\{')


@dataclass(slots=True)
class Rendered:
    """A chat request's messages as the renderer got them, its parameters, and the
    prompt text it rendered (UTF-8)."""

    messages: list[Any]
    params: Any
    prompt: bytes


# Set per request by the wrapped ``render_chat_request`` (the request's own task): the
# renders made for it land in this list (the renderer may run in child tasks, which see
# the same list).
_RENDERS: contextvars.ContextVar[list[Rendered] | None] = contextvars.ContextVar(
    "kvdisk_renders", default=None
)

RenderFn = Callable[[list[Any], Any], Awaitable[Any]]


def _role(message: Any) -> str | None:
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return role if isinstance(role, str) else None


def _common(a: bytes, b: bytes) -> int:
    return len(os.path.commonprefix([a, b]))


async def locate(byte: int, rendered: Rendered, render: RenderFn) -> dict[str, Any] | None:
    """The message the prompt's byte ``byte`` belongs to: the first message whose
    rendering (the conversation up to and including it) reaches past it; the tool
    definitions where the prompt rendered with and without tools differ. None when the
    byte lies after every message (the generation prompt) or a render fails."""
    messages, params, prompt = rendered.messages, rendered.params, rendered.prompt
    n = len(messages)
    if n == 0 or byte < 0:
        return None
    kwargs = dict(getattr(params, "chat_template_kwargs", None) or {})
    kwargs.update(add_generation_prompt=False, continue_final_message=False)

    async def text(k: int, tools: bool = True) -> bytes:
        kw = kwargs if tools else {**kwargs, "tools": None}
        _, out = await render(messages[:k], dataclasses.replace(params, chat_template_kwargs=kw))
        value = out.get("prompt") if isinstance(out, dict) else None
        if not isinstance(value, str):
            raise ValueError("the renderer produced no text")
        return value.encode()

    if kwargs.get("tools"):
        with_tools, without = await text(n), await text(n, tools=False)
        start = _common(with_tools, without)
        tail = _common(with_tools[start:][::-1], without[start:][::-1])
        if start <= byte < len(with_tools) - tail:
            return {"index": None, "role": "tools"}
    ends: dict[int, int] = {}

    async def end(k: int) -> int:  # where the prompt stops following messages[:k]
        if k not in ends:
            ends[k] = _common(await text(k), prompt)
        return ends[k]

    if await end(n) <= byte:
        return None
    lo, hi = 1, n  # the smallest k whose rendering reaches past the byte
    while lo < hi:
        mid = (lo + hi) // 2
        if await end(mid) > byte:
            hi = mid
        else:
            lo = mid + 1
    return {"index": lo - 1, "role": _role(messages[lo - 1])}


def report_of(params: Any) -> dict[str, Any] | None:
    report = params.get(REPORT_KEY) if isinstance(params, dict) else None
    return report if isinstance(report, dict) else None


class OutputTap:
    """Passes the engine's outputs through and keeps the last ``kv_transfer_params`` one
    carried (the final output's). Completions streams yield ``(index, output)``."""

    def __init__(self, source: Any):
        self._source = source
        self.params: dict[str, Any] | None = None

    def __aiter__(self) -> OutputTap:
        return self

    async def __anext__(self) -> Any:
        item = await self._source.__anext__()
        out = item[1] if isinstance(item, tuple) and len(item) == 2 else item
        params = getattr(out, PARAMS_KEY, None)
        if isinstance(params, dict):
            self.params = params
        return item

    async def aclose(self) -> None:
        close = getattr(self._source, "aclose", None)
        if close is not None:
            await close()


def _ends_a_choice_or_counts(body: str) -> bool:
    """A chunk that finishes a choice (a string ``finish_reason``) or carries usage: the
    only chunks that get the report (cheap: no JSON parse of the others)."""
    return _FINAL.search(body) is not None


def with_params(body: str, params: dict[str, Any]) -> str | None:
    """The chunk ``body`` with ``kv_transfer_params`` added, as an SSE line; None if it is
    not a JSON object."""
    try:
        chunk = json.loads(body)
    except ValueError:
        return None
    if not isinstance(chunk, dict):
        return None
    chunk[PARAMS_KEY] = params
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


class ResponseReports:
    """Installs the wrappers; ``render`` is the renderer's ``render_messages_async`` as it
    was before this module wrapped it (prefix renders go through it)."""

    def __init__(self, renderer: Any):
        self.renderer = renderer
        self.render: RenderFn = renderer.render_messages_async

    async def annotate(self, params: Any, renders: list[Rendered] | None) -> None:
        """Name the message of the report's divergence, in place."""
        report = report_of(params)
        divergence = report.get("divergence") if report is not None else None
        if not isinstance(divergence, dict) or not renders:
            return
        byte = divergence.get("byte")
        if not isinstance(byte, int):
            return
        try:
            divergence["message"] = await asyncio.wait_for(
                locate(byte, renders[-1], self.render), LOCATE_BUDGET_S
            )
        except Exception as exc:  # noqa: BLE001 - the rest of the report still stands
            log.debug("kvdisk: cannot place a divergence in the messages: %r", exc)

    async def stream(
        self, chunks: Any, tap: OutputTap, renders: list[Rendered] | None
    ) -> AsyncIterator[Any]:
        """Yields the SSE stream, the report added to each chunk that finishes a choice or
        carries usage once the engine returned it: the final chunk always carries it (the
        usage chunk when the client asked for usage, else the last choice's), and no chunk
        is held back or added."""
        annotated = False
        try:
            async for chunk in chunks:
                if (
                    tap.params is not None
                    and isinstance(chunk, str)
                    and chunk.startswith("data: {")
                    and _ends_a_choice_or_counts(chunk)
                ):
                    try:
                        if not annotated:
                            annotated = True
                            await self.annotate(tap.params, renders)
                        chunk = with_params(chunk[6:].strip(), tap.params) or chunk
                    except Exception:  # noqa: BLE001
                        log.exception("kvdisk: could not add the report to a stream")
                yield chunk
        finally:
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()

    def install(self, chat: Any, completion: Any) -> None:
        reports = self
        render = self.render

        async def recording_render(messages: Any, params: Any) -> Any:
            result = await render(messages, params)
            renders = _RENDERS.get()
            try:
                prompt = result[1].get("prompt") if isinstance(result, tuple) else None
                if renders is not None and isinstance(prompt, str):
                    renders.append(Rendered(list(messages), params, prompt.encode()))
            except Exception as exc:  # noqa: BLE001
                log.debug("kvdisk: not recording a render: %s", exc)
            return result

        self.renderer.render_messages_async = recording_render

        if chat is not None:
            render_chat_request = chat.render_chat_request

            async def recorded_render_chat_request(request: Any) -> Any:
                _RENDERS.set([])  # this request's task: read by the generator wrappers
                return await render_chat_request(request)

            chat.render_chat_request = recorded_render_chat_request

            full = chat.chat_completion_full_generator

            async def full_generator(
                request: Any, result_generator: Any, *args: Any, **kwargs: Any
            ) -> Any:
                renders = _RENDERS.get()
                response = await full(request, result_generator, *args, **kwargs)
                await reports.annotate(getattr(response, PARAMS_KEY, None), renders)
                return response

            chat.chat_completion_full_generator = full_generator

            chat_stream = chat.chat_completion_stream_generator

            def chat_stream_generator(
                request: Any, result_generator: Any, *args: Any, **kwargs: Any
            ) -> Any:
                tap = OutputTap(result_generator)
                chunks = chat_stream(request, tap, *args, **kwargs)
                return reports.stream(chunks, tap, _RENDERS.get())

            chat.chat_completion_stream_generator = chat_stream_generator

        if completion is not None:
            completion_stream = completion.completion_stream_generator

            def completion_stream_generator(
                request: Any, engine_prompts: Any, result_generator: Any, *a: Any, **kw: Any
            ) -> Any:
                tap = OutputTap(result_generator)
                chunks = completion_stream(request, engine_prompts, tap, *a, **kw)
                return reports.stream(chunks, tap, None)

            completion.completion_stream_generator = completion_stream_generator
