"""The API server's edge: what a client may not send to the engine.

``kv_transfer_params`` keys that start with ``kvdisk_`` are the server's own (the replay's
tool map, written by :mod:`vllm_kvdisk.replay.plugin`); a client that sends one could
plant ``id -> text`` in a checkpoint's ``KTM`` section. :func:`strip_internal_keys` wraps
the engine client's ``generate``, the one call every endpoint (chat, completions,
responses, beam search) makes, and drops those keys from every request unless the dict is
an :class:`OwnParams`, which only this package creates (a JSON body never yields one).
No vLLM import: the engine client is duck-typed.
"""

from __future__ import annotations

from typing import Any

from vllm_kvdisk.core.control import without_internal


class OwnParams(dict):  # type: ignore[type-arg]
    """``kv_transfer_params`` this plugin wrote (a client's JSON is never of this type):
    the only ones whose internal keys reach the engine."""


def strip_internal_keys(engine_client: Any) -> None:
    """Wrap ``engine_client.generate`` so that no request reaches the engine with internal
    ``kvdisk_*`` keys it did not get from this plugin: the one place every endpoint
    (chat, completions, responses, beam search) passes through."""
    generate = engine_client.generate

    def generate_without_internal_keys(prompt: Any, sampling_params: Any, *args: Any, **kw: Any):
        extra = getattr(sampling_params, "extra_args", None)
        params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
        if isinstance(extra, dict) and params is not None and not isinstance(params, OwnParams):
            cleaned = without_internal(params)
            if cleaned is not params:
                sampling_params.extra_args = {**extra, "kv_transfer_params": cleaned}
        return generate(prompt, sampling_params, *args, **kw)

    engine_client.generate = generate_without_internal_keys
