"""What kvdisk reads from the installed vLLM outside the hooks the scheduler tests drive:
request and scheduler-output fields, the block pool calls the state hand-off makes, and the
API server methods the tool-call replay plugin wraps. A release that renames one of them
fails here, by name, instead of at a user's first request.

The API server is read from its source (``ast``): importing it needs the server's own
dependencies, which the scheduler-only venv of a newer vLLM does not install.
"""

import ast
import dataclasses
import importlib.util
import pathlib

import vllm_api as api


def test_requests_carry_what_the_scheduler_half_reads():
    request = api.make_request(list(range(100, 300)), kv_transfer_params={"k": 1})
    for name in (
        "request_id",
        "prompt_token_ids",
        "all_token_ids",
        "num_tokens",
        "num_prompt_tokens",
        "num_computed_tokens",
        "cache_salt",
        "lora_request",
        "kv_transfer_params",
        "block_hashes",
    ):
        assert hasattr(request, name), name
    assert list(request.all_token_ids[:3]) == [100, 101, 102]


def test_scheduler_output_and_connector_output_fields():
    from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput

    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {
        "num_scheduled_tokens",
        "total_num_scheduled_tokens",
        "preempted_req_ids",
        "kv_connector_block_state",
    } <= fields
    assert "boundary_state_offloads" in {f.name for f in dataclasses.fields(KVConnectorBlockState)}
    out = {f.name for f in dataclasses.fields(api.KVConnectorOutput)}
    assert {
        "finished_sending",
        "finished_recving",
        "invalid_block_ids",
        "kv_connector_worker_meta",
    } <= out


def test_the_block_pool_takes_the_pins_of_state_hand_offs(make_engine):
    """``statehandoffs``: ``touch`` pins a handed-over block, ``free_blocks`` gives it
    back; the connector finds the pool and its null block through the manager."""
    engine = make_engine()
    pool = engine.kvdisk.states.pool
    assert pool is engine.s.kv_cache_manager.block_pool
    assert engine.kvdisk.blocks.null_block == pool.null_block.block_id
    block = pool.blocks[5]
    free = pool.get_num_free_blocks()
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == free - 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == free


def _class_source(module: str, cls: str) -> ast.ClassDef:
    path = pathlib.Path(importlib.util.find_spec("vllm").origin).parent
    path = path.joinpath(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)


def _methods(node: ast.ClassDef) -> set[str]:
    return {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _self_calls(node: ast.ClassDef) -> set[str]:
    return {
        n.func.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
    }


def test_the_chat_handler_still_calls_what_the_replay_plugin_wraps():
    """The plugin wraps, on the app's ``openai_serving_chat`` instance, the methods the
    OpenAI chat path calls through ``self`` (vLLM 0.34's stream generator delegates to a
    new ``*_raw`` inside: the wrapper sits outside it and still sees every chunk)."""
    chat = _class_source("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat")
    wrapped = {
        "render_chat_request",
        "chat_completion_full_generator",
        "chat_completion_stream_generator",
    }
    assert wrapped <= _methods(chat)
    assert wrapped <= _self_calls(chat)
    renderer = _class_source("vllm.renderers.base", "BaseRenderer")
    assert {"render_messages_async", "get_tokenizer"} <= _methods(renderer)
    tokenize = _class_source("vllm.entrypoints.serve.tokenize.serving", "ServingTokenization")
    assert "create_tokenize" in _methods(tokenize)
