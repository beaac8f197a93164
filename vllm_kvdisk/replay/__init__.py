"""Exact replay of tool calls (API-server side; the connector only writes KTM sections).

A chat client sends an assistant tool call back as structured data (``name`` and an
``arguments`` JSON string); the chat template re-serialises it in its own spacing and key
order, so the next prompt differs from the tokens the model sampled and every prefix cache,
vLLM's and ours, stops at the tool call. ds4-server keeps a map from the tool-call id to the
exact block the model generated and re-emits that block instead. So do we.

Three maps from a tool-call id, each in its own module:

* :mod:`.memory`: in memory, (tenant, id) -> the sampled turn (text, token ids, what the
  client saw, the digest of the prompt it was sampled after), an LRU of at most
  ``tool_memory_max_ids`` ids and ``tool_memory_max_mb``;
* :mod:`.log`: the **tool-call log** (``ROOT/toolmap/*.ktl``), every call this process
  returned, appended before the response leaves, read by every API server and after a
  restart;
* :mod:`.ktm`: the **KTM sections** of checkpoint files (id -> exact text, no ids), the
  seed's map, written by the connector from ``kv_transfer_params["kvdisk_tool_map"]``
  (which only this plugin writes: a client's ``kvdisk_*`` keys are dropped at the edge),
  each pair under its file's namespace.

Every record carries its scope (tenant and prompt digest): nothing replays into another
tenant's request, after another prompt, or with text the client did not receive.

And the modules that use them, in import order: :mod:`.messages` (what a message says,
normalised), :mod:`.turns` (which turns replay; sentinels and splicing),
:mod:`.capture` (sampled ids beside the calls the client received), :mod:`.plugin`
(the ``vllm.endpoint_plugins`` glue, the only module that touches vLLM, lazily).
"""
