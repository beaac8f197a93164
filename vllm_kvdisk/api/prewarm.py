"""``POST /v1/kvdisk/prewarm``: compute and save a prompt's checkpoints without answering
it, and return once they are on disk (e.g. a shared system prompt before a fleet takes
traffic: every replica's first request then restores it).

The body is a chat completions body (``messages``, optionally ``tools``, ``cache_salt``,
``kv_transfer_params`` such as ``{"kvdisk": {"pin_s": 3600}}``) plus ``wait_s`` (how long
to wait for the files, 0 to 600, default 60). The request runs through vLLM's own chat
handler with one generated token (vLLM computes at least one), so it is rendered, salted
(the tenancy gate rewrites this route's body like the chat route's), authenticated and
scheduled as any chat request. The answer::

    {"prompt_tokens": 2048, "checkpoints": ["<sha1>", ...], "on_disk": true,
     "kvdisk": {...the response's report...}}

``checkpoints``: the files its saves wrote (none when the disk held the prefix already:
``kvdisk.reason`` is then null); ``on_disk``: each of them was found in the cache
directory within ``wait_s``. A bad body is a 400 with a message, never an engine error.
No vLLM import at module level.
"""

from __future__ import annotations

import asyncio
import glob
import os
import time
from typing import Any

from vllm_kvdisk.core.control import MAX_PIN_S
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.core.report import REPORT_KEY

log = get_logger(__name__)

ROUTE = "/v1/kvdisk/prewarm"
MAX_WAIT_S = 600
DEFAULT_WAIT_S = 60
POLL_S = 0.05


class BadPrewarm(ValueError):
    pass


def checked_body(body: Any) -> tuple[dict[str, Any], float]:
    """The chat body to run (one token, not streamed) and the wait; BadPrewarm names what
    is wrong."""
    if not isinstance(body, dict):
        raise BadPrewarm("the body must be a JSON object")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise BadPrewarm("messages: a non-empty list is required")
    wait = body.get("wait_s", DEFAULT_WAIT_S)
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= MAX_WAIT_S:
        raise BadPrewarm(f"wait_s: a number of seconds from 0 to {MAX_WAIT_S}")
    if body.get("stream") or body.get("n", 1) != 1:
        raise BadPrewarm("stream and n are not for a prewarm")
    params = body.get("kv_transfer_params")
    control = params.get(REPORT_KEY) if isinstance(params, dict) else None
    pin = control.get("pin_s") if isinstance(control, dict) else None
    if pin is not None and (
        not isinstance(pin, int) or isinstance(pin, bool) or not 0 < pin <= MAX_PIN_S
    ):
        raise BadPrewarm(f"kv_transfer_params.kvdisk.pin_s: whole seconds from 1 to {MAX_PIN_S}")
    run = {k: v for k, v in body.items() if k != "wait_s"}
    run.update(max_tokens=1, stream=False)
    run.pop("max_completion_tokens", None)
    return run, float(wait)


def on_disk(root: str, sha1s: list[str]) -> bool:
    """Every checkpoint named is a ``.kv`` file of some namespace of ``root``."""
    return all(
        len(sha1) == 40
        and all(c in "0123456789abcdef" for c in sha1)
        and glob.glob(os.path.join(glob.escape(root), "*", sha1 + ".kv"))
        for sha1 in sha1s
    )


async def wait_on_disk(root: str, sha1s: list[str], wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        if await asyncio.to_thread(on_disk, root, sha1s):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL_S)


def install(app: Any, kv_dir: Any) -> None:
    """Add the route to vLLM's FastAPI ``app``; ``kv_dir()`` says the cache directory
    (None until the plugin read the engine's settings: the route answers 503 then)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    async def prewarm(raw_request: Request) -> Any:
        root = kv_dir()
        chat = getattr(raw_request.app.state, "openai_serving_chat", None)
        if root is None or chat is None:
            return JSONResponse({"error": "kvdisk prewarm is not available"}, status_code=503)
        try:
            body, wait_s = checked_body(await raw_request.json())
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

            request = ChatCompletionRequest.model_validate(body)
        except Exception as exc:  # noqa: BLE001 - a client's body: a 400, with its message
            return JSONResponse({"error": f"kvdisk prewarm: {exc}"}, status_code=400)
        result = await chat.create_chat_completion(request, raw_request)
        params = getattr(result, "kv_transfer_params", None)
        if not isinstance(params, dict):
            error = getattr(result, "error", None)
            code = int(getattr(error, "code", 500) or 500)
            dump = result.model_dump() if hasattr(result, "model_dump") else {}
            return JSONResponse(dump or {"error": "no report from the engine"}, status_code=code)
        report = params.get(REPORT_KEY) or {}
        saves = [s for s in report.get("saves") or [] if isinstance(s, str)]
        landed = await wait_on_disk(root, saves, wait_s)
        usage = getattr(result, "usage", None)
        return JSONResponse(
            {
                "prompt_tokens": getattr(usage, "prompt_tokens", None),
                "checkpoints": saves,
                "on_disk": landed,
                REPORT_KEY: report,
            }
        )

    # This module's annotations are strings (``from __future__``) naming a local import:
    # FastAPI must be handed the class to inject the request.
    prewarm.__annotations__ = {"raw_request": Request, "return": Any}
    app.add_api_route(ROUTE, prewarm, methods=["POST"])
