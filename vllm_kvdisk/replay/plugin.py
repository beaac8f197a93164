"""vLLM glue for exact tool-call replay (:mod:`vllm_kvdisk.replay`), API-server process only.

It is a ``vllm.endpoint_plugins`` entry point named ``kvdisk_replay``. vLLM loads endpoint
plugins only when ``VLLM_PLUGINS`` names them (and that variable then also filters the
general plugins, so it must name ``kvdisk`` too); ``vllm-kvdisk serve`` sets it. With plain
``vllm serve``::

    VLLM_PLUGINS=kvdisk,kvdisk_replay vllm serve MODEL \
        --kv-transfer-config '{"kv_connector":"kvdisk",...}' \
        --enable-auto-tool-choice --tool-call-parser hermes

(on vLLM's CPU backend with ``VLLM_CPU_NUM_OF_RESERVED_CPU`` set to TP x PP too, as
``vllm-kvdisk serve`` sets it: see :func:`vllm_kvdisk.serve.reserved_cpus`).

It adds one route, ``POST /v1/kvdisk/prewarm`` (:mod:`vllm_kvdisk.api.prewarm`).
``attach_router`` puts the tenancy gate (:mod:`vllm_kvdisk.api.tenancy`: each request's
``cache_salt`` from its tenant) in front of vLLM's handlers. ``init_state``
configures the gate and wraps, on the app's own handler objects (instance
attributes; no vLLM class is patched):

* ``engine_client.generate``: every request of every endpoint loses the internal
  ``kvdisk_*`` keys a client put in its ``kv_transfer_params`` (a planted tool map); only
  the map this plugin wrote itself (a dict of its own type) passes. Installed even with
  replay off;

* ``OpenAIServingChat.render_chat_request``: plans the replay (which assistant messages
  carry known ids with unchanged arguments), renders, then adds ``kvdisk_tool_map`` to the
  request's ``kv_transfer_params`` (merged with the client's) and writes the trace line;
* the renderer's ``render_messages_async``: renders replayed messages as sentinels and
  splices the sampled token ids in their place (a token prompt, so vLLM does not
  re-tokenize);
* ``chat_completion_full_generator`` / ``chat_completion_stream_generator``: see each
  response's tool-call ids (as sent to the client, streamed or not) beside the token ids the
  engine sampled and the prompt's, and remember them under the request's tenant (LoRA
  adapter and cache salt) and the digest of that prompt;
* ``ServingTokenization.create_tokenize``: ``/tokenize`` shows the same prompt as a chat.

Settings come from the kvdisk ``kv_connector_extra_config`` the engine was started with:
``kv_disk_dir`` (KTM sections are read from it at start-up, in a thread),
``tool_memory_max_ids`` (0 turns replay off), ``tool_memory_max_mb`` and ``trace``.
Nothing here can fail a request: any error renders the request as usual and is logged.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import os
import threading
import time
from importlib.metadata import entry_points
from typing import Any

from vllm_kvdisk.api.tenancy import STATE_KEY
from vllm_kvdisk.core.control import MAP_KEY, without_internal
from vllm_kvdisk.core.keys import salt_digest
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.replay.capture import Tap, capture_stream
from vllm_kvdisk.replay.edge import OwnParams, strip_internal_keys
from vllm_kvdisk.replay.ktm import DiskToolMaps
from vllm_kvdisk.replay.log import ToolCall, ToolLog
from vllm_kvdisk.replay.memory import (
    ToolMemory,
    ToolRecord,
    compact_ids,
    exact_text,
    prefix_digest,
    strip_stop,
    tenant_key,
)
from vllm_kvdisk.replay.messages import Signature, make_signature, message_tool_ids
from vllm_kvdisk.replay.turns import (
    Plan,
    PrefixMismatch,
    TurnOpening,
    plan_replay,
    sentinel_messages,
    splice,
    turn_opening,
)

log = get_logger(__name__)

PLUGIN_NAME = "kvdisk_replay"
GENERAL_PLUGIN_NAME = "kvdisk"
DISK_POLL_INTERVAL_S = 2.0
STARTUP_LOAD_WAIT_S = 30.0
_ACTIVE: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("kvdisk_replay", default=None)
# The cache salt the tenancy gate chose for a request whose body has no such field.
_GATE_SALT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvdisk_gate_salt", default=None
)


def root_salt_key(kv_dir: str) -> bytes:
    """The cache directory's key of salt digests, made if the engine has not made it yet."""
    from vllm_kvdisk.storage import secret

    fd = os.open(kv_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return secret.salt_key(fd, create=True) or b""
    finally:
        os.close(fd)


# Plugins that treat being named in VLLM_PLUGINS as an opt-in (the Hub LoRA resolver
# downloads adapters only then): never name them on the user's behalf.
_OPT_IN_PLUGINS = frozenset({"lora_hf_hub_resolver"})


def plugins_env(current: str | None) -> str:
    """A ``VLLM_PLUGINS`` value that enables this plugin and changes nothing else: unset
    means "every installed plugin", so list them all, except endpoint plugins (off while
    unset) and opt-in ones (inert while unset)."""
    if current is not None:
        names = [n for n in current.split(",") if n]
    else:
        names = []
        for group in (
            "vllm.general_plugins",
            "vllm.platform_plugins",
            "vllm.io_processor_plugins",
            "vllm.stat_logger_plugins",
        ):
            names += [ep.name for ep in entry_points(group=group) if ep.name not in _OPT_IN_PLUGINS]
    for name in (GENERAL_PLUGIN_NAME, PLUGIN_NAME):
        if name not in names:
            names.append(name)
    return ",".join(dict.fromkeys(names))


class ReplayPlugin:
    """The ``vllm.endpoint_plugins`` factory (see ``vllm/plugins/endpoint_plugins``)."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def __init__(self) -> None:
        from vllm_kvdisk.api.tenancy import TenancyGate

        self.tenancy = TenancyGate()
        self.kv_dir: str | None = None  # the cache directory, once init_state read it

    def attach_router(self, app: Any) -> None:
        """One route, ``POST /v1/kvdisk/prewarm`` (:mod:`vllm_kvdisk.api.prewarm`); the
        tenancy gate goes in front of vLLM's handlers (inert until ``init_state``
        configures it); everything else wraps handlers."""
        from vllm_kvdisk.api.prewarm import install as install_prewarm
        from vllm_kvdisk.api.tenancy import TenancyMiddleware

        app.add_middleware(TenancyMiddleware, gate=self.tenancy)
        install_prewarm(app, lambda: self.kv_dir)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if engine_client is None:
            return
        config = kvdisk_config(engine_client.vllm_config)
        self._init_replay(engine_client, state, config)
        if config is not None:  # after the replay's wrappers: it records what they render
            self.kv_dir = config.kv_disk_dir
            try:
                from vllm_kvdisk.api.report import ResponseReports

                ResponseReports(engine_client.renderer).install(
                    getattr(state, "openai_serving_chat", None),
                    getattr(state, "openai_serving_completion", None),
                )
            except Exception as exc:  # noqa: BLE001 - responses go out as vLLM writes them
                log.warning("kvdisk: responses carry no report in streams (%s)", exc)

    def _init_replay(self, engine_client: Any, state: Any, config: Any) -> None:
        if config is not None:  # with replay off too: no client plants a map for others
            strip_internal_keys(engine_client)
            self.tenancy.configure(
                config.kv_tenant_from, config.kv_tenant_header, config.kv_tenant_required
            )
            log.info(
                "kvdisk: cache salt per tenant from %s%s",
                config.kv_tenant_from,
                " (required)" if config.kv_tenant_required else "",
            )
        chat = getattr(state, "openai_serving_chat", None)
        if chat is None:
            return
        if config is None:
            log.warning(
                "kvdisk replay: the kvdisk connector is not configured; tool-call replay is off"
            )
            return
        if config.tool_memory_max_ids == 0:
            log.info("kvdisk replay: tool_memory_max_ids is 0; tool-call replay is off")
            return
        try:
            model = str(engine_client.vllm_config.model_config.model)
            replayer = Replayer(config, engine_client.renderer, chat, model)
        except Exception as exc:  # noqa: BLE001 - never stop the server for an optional feature
            log.warning("kvdisk replay: off (%s)", exc)
            return
        replayer.install(chat, getattr(state, "serving_tokenization", None))
        state.kvdisk_replayer = replayer


def kvdisk_config(vllm_config: Any) -> Any:
    from vllm_kvdisk.core.config import load_config

    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None or (
        transfer.kv_connector != "kvdisk"
        and getattr(transfer, "kv_connector_module_path", None) != "vllm_kvdisk.connector.facade"
    ):
        return None
    return load_config(dict(transfer.kv_connector_extra_config or {}), os.environ)


class Replayer:
    def __init__(self, config: Any, renderer: Any, chat: Any, model: str = ""):
        from vllm_kvdisk.core.tokens import table_from_tokenizer
        from vllm_kvdisk.ops.trace import Trace

        self.renderer = renderer
        self.tokenizer = renderer.get_tokenizer()
        self.table = table_from_tokenizer(self.tokenizer)
        self.special_ids = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        self.chat = chat
        self.model = model
        # The root's key of cache-salt digests (storage/secret.py): a request's tenant is
        # named by the same keyed digest as its namespace.
        self.salt_key = root_salt_key(config.kv_disk_dir)
        max_bytes = config.tool_memory_max_mb << 20
        self.memory = ToolMemory(config.tool_memory_max_ids, max_bytes)
        self.trace = Trace.from_config(config)
        self.disk = DiskToolMaps(config.kv_disk_dir)
        # The log's scope: this tokenizer and this model (records of others are skipped).
        scope = self.table.digest() + ":" + hashlib.sha256(model.encode()).hexdigest()[:16]
        self.log = ToolLog(config.kv_disk_dir, scope, config.tool_memory_max_ids, max_bytes)
        self.markup = self._markup()
        self._loaded = threading.Event()
        self._last_poll = 0.0
        threading.Thread(target=self._initial_load, name="kvdisk-replay-load", daemon=True).start()

    # -- disk ---------------------------------------------------------------------------
    def _initial_load(self) -> None:
        started = time.monotonic()
        try:
            calls = self._poll_log()
            folded = self.log.fold_dead(self._newest())
            from_log = sum(len(c.ids) for c in calls)
            from_files = self._poll_files()
            log.info(
                "kvdisk replay: %d tool-call id(s) from the tool-call log (%d old log(s) "
                "folded), %d from checkpoint files, in %.2f s",
                from_log,
                folded,
                from_files,
                time.monotonic() - started,
            )
        except Exception:  # noqa: BLE001
            log.exception("kvdisk replay: reading tool maps failed")
        finally:
            self._loaded.set()

    def _poll_log(self) -> list[ToolCall]:
        """Tool calls other API servers (or this one before a restart) returned."""
        calls = self.log.poll()
        for call in calls:
            record = ToolRecord(
                call.text,
                compact_ids(call.token_ids),
                None,
                origin="disk",
                tenant=call.tenant,
                prefix=call.prefix,
            )
            for tid in call.ids:
                self.memory.add_if_absent(call.tenant, tid, record)
        return calls

    def _poll_files(self) -> int:
        """The KTM sections of this model's checkpoint files (the seed's tool map; no
        token ids), each under the tenant of its file's namespace."""
        added = 0
        for tid, text, ns, sha1, tenant in self.disk.poll(self._namespace_tenant):
            record = ToolRecord(text, None, None, origin="disk", source=(ns, sha1), tenant=tenant)
            added += self.memory.add_if_absent(tenant, tid, record)
        return added

    def _namespace_tenant(self, info: dict[str, Any]) -> str | None:
        """The tenant of a namespace whose ``namespace.json`` says ``info``; None for
        another model's."""
        if info.get("model") != self.model:
            return None
        lora, salt = info.get("lora", ""), info.get("salt_digest", "")
        if not isinstance(lora, str) or not isinstance(salt, str):
            return None
        return tenant_key(lora, salt)

    def tenant(self, request: Any) -> str:
        """A request's replay scope within this model: its LoRA adapter (the ``model`` it
        names, unless that is the base model) and its cache salt (digest)."""
        name = getattr(request, "model", None) or ""
        models = getattr(self.chat, "models", None)
        try:
            base = not name or (models is not None and models.is_base_model(name))
        except Exception:  # noqa: BLE001 - unknown: its own scope, never the base's
            base = False
        lora = "" if base else str(name)
        salt = getattr(request, "cache_salt", None) or _GATE_SALT.get()
        return tenant_key(lora, salt_digest(salt, key=self.salt_key))

    def _markup(self) -> list[str]:
        """The strings of tool-call syntax a client is not shown: the tool parser's tags
        (its ``*_token`` attributes) and the tokenizer's special tokens."""
        out = [str(t) for t in getattr(self.tokenizer, "all_special_tokens", None) or []]
        parser_cls = getattr(self.chat, "parser_cls", None)
        if parser_cls is None:
            return out
        holders: list[Any] = [parser_cls, getattr(parser_cls, "tool_parser_cls", None)]
        try:
            parser = parser_cls(
                self.tokenizer,
                None,
                chat_template_kwargs={},
                model_config=self.chat.model_config,
            )
            holders += [parser, getattr(parser, "_tool_parser", None)]
        except Exception as exc:  # noqa: BLE001 - the class attributes are still there
            log.debug("kvdisk replay: no tool parser instance: %s", exc)
        for holder in holders:
            for name in dir(holder) if holder is not None else []:
                if name.endswith(("_token", "_tokens")) and not name.startswith("__"):
                    try:
                        value = getattr(holder, name, None)
                    except Exception:  # noqa: BLE001 - a property that needs state
                        continue
                    values = value if isinstance(value, (list, tuple, set)) else [value]
                    out += [v for v in values if isinstance(v, str) and v]
        return sorted(set(out))

    def _poll_disk(self) -> None:
        self._last_poll = time.monotonic()
        self._poll_log()
        self._poll_files()

    async def _refresh_for(self, tenant: str, ids: list[str]) -> None:
        """Unknown ids: wait for the start-up load, and look for files written since."""
        if all(self.memory.contains(tenant, tid) for tid in ids):
            return
        if not self._loaded.is_set():
            await asyncio.to_thread(self._loaded.wait, STARTUP_LOAD_WAIT_S)
        elif time.monotonic() - self._last_poll >= DISK_POLL_INTERVAL_S:
            await asyncio.to_thread(self._poll_disk)

    # -- planning -----------------------------------------------------------------------
    def _sign(self, record: ToolRecord, tools: Any) -> Signature | None:
        """A disk record's text parsed by the server's own tool parser, as the response
        that produced it was."""
        parser_cls = getattr(self.chat, "parser_cls", None)
        if parser_cls is None:
            return None
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
        )

        try:
            tool_dicts = [t.model_dump() if hasattr(t, "model_dump") else t for t in tools or []]
            request = ChatCompletionRequest(  # type: ignore[call-arg]  # seed: optional
                messages=[{"role": "user", "content": ""}],
                tools=tool_dicts or None,
                tool_choice="auto",
            )
            parser = parser_cls(
                self.tokenizer,
                request.tools,
                chat_template_kwargs={},
                model_config=self.chat.model_config,
            )
            reasoning, content, calls = parser.parse(record.text, request, enable_auto_tools=True)
        except Exception as exc:  # noqa: BLE001 - a parser failure means "do not replay"
            log.debug("kvdisk replay: cannot parse a recorded tool call: %s", exc)
            return None
        if not calls:
            return None
        return make_signature(content, [(c.name, c.arguments) for c in calls], reasoning)

    async def prepare(self, request: Any) -> Plan | None:
        messages = list(getattr(request, "messages", None) or [])
        for message in messages:
            # pydantic may hand ``tool_calls`` over as a one-shot iterator (/tokenize does):
            # read it once into a list vLLM can read again.
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            if calls is not None and not isinstance(calls, (list, tuple)):
                message["tool_calls"] = list(calls)
        ids = [tid for m in messages for tid in message_tool_ids(m)]
        if not ids:
            return None
        tenant = self.tenant(request)
        await self._refresh_for(tenant, ids)
        tools = getattr(request, "tools", None)
        plan = plan_replay(
            messages, self.memory, lambda r: self._sign(r, tools), tenant, self.markup
        )
        if getattr(request, "add_special_tokens", False) and plan.replays:
            plan.fallback, plan.replays = "add_special_tokens is set", []
        for replay in plan.replays:
            record = replay.record
            if record.token_ids is None and record.source is not None:
                source, record.source = record.source, None  # one try; else never replayed
                found = await asyncio.to_thread(
                    self.disk.recover_tokens, *source, record.text, self.table
                )
                if found is not None:
                    record.prefix, tokens = found
                    record.token_ids = compact_ids(tokens)
        return plan

    def finish(self, request: Any, plan: Plan) -> None:
        self.trace.replay(plan.summary())
        if not plan.replays or not hasattr(request, "kv_transfer_params"):
            return
        params = OwnParams(without_internal(request.kv_transfer_params) or {})
        params[MAP_KEY] = plan.tool_map()
        request.kv_transfer_params = params

    # -- rendering ----------------------------------------------------------------------
    async def render(self, original: Any, messages: Any, params: Any) -> Any:
        plan = _ACTIVE.get()
        if plan is None or not plan.replays:
            return await original(messages, params)
        result, opening = None, None
        while plan.replays:  # each round drops the first turn whose prompt differs
            swapped, sentinels = sentinel_messages(messages, plan.replays)
            try:
                conversation, prompt = await original(swapped, params)
                text = prompt.get("prompt") if isinstance(prompt, dict) else None
                if (
                    not isinstance(text, str)
                    or "prompt_token_ids" in prompt
                    or "multi_modal_data" in prompt
                ):
                    result, why = None, "the renderer does not produce text"
                else:
                    if opening is None:
                        opening = await self._opening(original, params, sentinels[0])
                    result = await asyncio.to_thread(
                        splice, text, sentinels, plan.replays, self._encode, opening
                    )
                    why = "the chat template did not render a replayed message verbatim"
            except PrefixMismatch as miss:
                plan.drop_from(miss.index, "it was sampled after another prompt")
                continue
            except Exception as exc:  # noqa: BLE001 - e.g. a template that insists on tool_calls
                result, why = None, f"rendering failed: {exc}"
            break
        else:
            return await original(messages, params)
        if result is None:
            plan.fallback, plan.replays = why, []
            return await original(messages, params)
        ids, text = result
        out = {k: v for k, v in prompt.items() if k != "prompt"}
        out.update(prompt_token_ids=ids, prompt=text)
        by_sentinel = {s: r.record.text for s, r in zip(sentinels, plan.replays)}
        for message in conversation:
            if isinstance(message, dict) and message.get("content") in by_sentinel:
                message["content"] = by_sentinel[message["content"]]
        return conversation, out

    async def _opening(self, original: Any, params: Any, sentinel: str) -> TurnOpening | None:
        """How this template opens an assistant turn after a generation prompt and before
        plain content (two renders of a one-message conversation). None if it cannot be
        told: the turns are then spliced where the template put the content."""
        import dataclasses

        try:
            kwargs = dict(params.chat_template_kwargs or {})
            kwargs.pop("continue_final_message", None)
            user = {"role": "user", "content": "q"}
            _, gen = await original(
                [user],
                dataclasses.replace(
                    params, chat_template_kwargs={**kwargs, "add_generation_prompt": True}
                ),
            )
            _, content = await original(
                [user, {"role": "assistant", "content": sentinel}],
                dataclasses.replace(
                    params, chat_template_kwargs={**kwargs, "add_generation_prompt": False}
                ),
            )
            return turn_opening(gen["prompt"], content["prompt"], sentinel)
        except Exception as exc:  # noqa: BLE001 - a template that refuses this conversation
            log.debug("kvdisk replay: cannot tell how turns open: %s", exc)
            return None

    def _encode(self, text: str) -> list[int]:
        # The template wrote any BOS itself; vLLM's chat default adds none either.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # -- capture ------------------------------------------------------------------------
    def remember(
        self,
        token_ids: list[int],
        ids: list[str],
        signature: Signature,
        tenant: str,
        prompt_ids: list[int] | None,
    ) -> None:
        if not ids or signature.reasoning or not prompt_ids:
            return  # reasoning turns: templates drop or reformat reasoning; never replayed
        sampled = strip_stop(token_ids, self.special_ids)
        text = exact_text(self.table, sampled)
        if text is None:
            return
        prefix = prefix_digest(prompt_ids)
        tokens = compact_ids(sampled)
        record = ToolRecord(text, tokens, signature, "memory", tenant=tenant, prefix=prefix)
        for tid in ids:
            self.memory.put(tenant, tid, record)
        # Durable before the response leaves: a restart right after it still replays.
        self.log.append(ToolCall(tuple(ids), text, tokens, tenant, prefix), self._newest)

    def _newest(self) -> list[ToolCall]:
        return [
            ToolCall(tuple(ids), r.text, r.token_ids, r.tenant, r.prefix)
            for ids, r in self.memory.records()
            if r.token_ids is not None and r.prefix is not None
        ]

    def remember_response(self, response: Any, tap: Tap) -> None:
        for choice in getattr(response, "choices", None) or []:
            message = getattr(choice, "message", None)
            calls = getattr(message, "tool_calls", None) or []
            if not calls:
                continue
            signature = make_signature(
                getattr(message, "content", None),
                [(c.function.name, c.function.arguments) for c in calls],
                getattr(message, "reasoning", None),
            )
            self.remember(
                tap.tokens.get(choice.index, []),
                [c.id for c in calls],
                signature,
                tap.tenant,
                tap.prompt,
            )

    # -- installation -------------------------------------------------------------------
    def install(self, chat: Any, tokenization: Any) -> None:
        replayer = self
        render_original = self.renderer.render_messages_async

        async def render_messages_async(messages, params):
            return await replayer.render(render_original, messages, params)

        self.renderer.render_messages_async = render_messages_async

        render_chat_request = chat.render_chat_request

        async def planned_render_chat_request(request):
            request.kv_transfer_params = without_internal(request.kv_transfer_params)
            plan = await replayer._safe_prepare(request)
            token = _ACTIVE.set(plan)
            try:
                result = await render_chat_request(request)
            finally:
                _ACTIVE.reset(token)
            if plan is not None and isinstance(result, tuple):
                replayer.finish(request, plan)
            return result

        chat.render_chat_request = planned_render_chat_request

        full_generator = chat.chat_completion_full_generator

        async def chat_completion_full_generator(request, result_generator, *args, **kwargs):
            tap = Tap(result_generator, delta=False, tenant=replayer.tenant(request))
            response = await full_generator(request, tap, *args, **kwargs)
            try:
                replayer.remember_response(response, tap)
            except Exception:  # noqa: BLE001
                log.exception("kvdisk replay: could not record a response")
            return response

        chat.chat_completion_full_generator = chat_completion_full_generator

        stream_generator = chat.chat_completion_stream_generator

        def chat_completion_stream_generator(request, result_generator, *args, **kwargs):
            tap = Tap(result_generator, delta=True, tenant=replayer.tenant(request))
            return capture_stream(replayer, stream_generator(request, tap, *args, **kwargs), tap)

        chat.chat_completion_stream_generator = chat_completion_stream_generator

        if tokenization is not None:
            create_tokenize = tokenization.create_tokenize

            async def planned_create_tokenize(request, raw_request):
                # /tokenize carries no cache_salt: the tenancy gate left the request's
                # salt in its ASGI state.
                state = (getattr(raw_request, "scope", None) or {}).get("state") or {}
                salt = _GATE_SALT.set(state.get(STATE_KEY))
                try:
                    plan = await replayer._safe_prepare(request)
                finally:
                    _GATE_SALT.reset(salt)
                token = _ACTIVE.set(plan)
                try:
                    return await create_tokenize(request, raw_request)
                finally:
                    _ACTIVE.reset(token)

            tokenization.create_tokenize = planned_create_tokenize

    async def _safe_prepare(self, request: Any) -> Plan | None:
        try:
            return await self.prepare(request)
        except Exception:  # noqa: BLE001
            log.exception("kvdisk replay: planning failed; rendering as usual")
            return None
