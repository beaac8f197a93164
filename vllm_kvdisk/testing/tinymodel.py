"""Build a tiny random-weight Llama + BPE tokenizer offline, for tests.

The build is seeded and byte-identical on rebuild, so tests can build it instead of
committing ~20 MB of weights. Usage: ``python -m vllm_kvdisk.testing.tinymodel OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Bump when the build recipe changes, so stale cached models get rebuilt.
_BUILD_VERSION = 1
_MARKER = "tinymodel.json"
# The BPE corpus only needs to be big enough to learn ~4k merges; the cap keeps
# training at about a second.
_CORPUS_CAP_BYTES = 2 * 1024 * 1024

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# Control tokens get the lowest ids (0..4). The tool-call tags are added as
# non-special tokens (as Qwen/Hermes do): special tokens are stripped by
# skip_special_tokens, and a tool-call parser must still see the tags in the text.
_SPECIAL = [BOS, EOS, PAD, IM_START, IM_END]
_ADDED = [TOOL_CALL_START, TOOL_CALL_END]

# ChatML / Hermes-style template (shape of Qwen2.5's). Tool results are grouped into
# one user turn wrapped in <tool_response>; arguments that are already a JSON string
# (raw OpenAI form) are emitted verbatim, dicts go through tojson.
CHAT_TEMPLATE = r"""
{%- if tools or messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}
    {%- if tools %}
        {{- '\n\n# Tools\n\nYou may call one or more functions. Function signatures are'
            + ' within <tools></tools> XML tags:\n<tools>' }}
        {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
        {{- '\n</tools>\n\nFor each function call, return a json object within'
            + ' <tool_call></tool_call> XML tags:\n<tool_call>\n'
            + '{"name": <function-name>, "arguments": <args-json-object>}'
            + '\n</tool_call>' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'system' and loop.first %}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + (m.content or '') + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if m.content %}{{- '\n' + m.content }}{%- endif %}
        {%- for tc in (m.tool_calls or []) %}
            {%- set f = tc.function if tc.function is defined else tc %}
            {{- '\n<tool_call>\n{"name": "' + f.name + '", "arguments": ' }}
            {%- if f.arguments is string %}{{- f.arguments }}
            {%- else %}{{- f.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\n' + (m.content or '') + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


# The default shape is the tiny test model; benchmarks ask for bigger ones (more KV bytes
# per token, slower prefill) through the same builder.
TINY_SHAPE = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2}


ARCHS = ("llama", "gemma3", "qwen3next")
GEMMA3_WINDOW = 256


def _params(
    seed: int, vocab_size: int, shape: dict[str, int], arch: str = "llama"
) -> dict[str, int | str]:
    params: dict[str, int | str] = {
        "build_version": _BUILD_VERSION,
        "seed": seed,
        "vocab_size": vocab_size,
    }
    if shape != TINY_SHAPE:  # keep the tiny model's marker (and cached builds) unchanged
        params.update(shape)
    if arch != "llama":
        params["arch"] = arch
    return params


def _corpus() -> Iterator[str]:
    """Local Python sources in sorted order (deterministic), capped in size."""
    roots = [pathlib.Path(sysconfig.get_paths()["stdlib"])]
    # Fallback for stripped interpreters that ship only .pyc files.
    import transformers

    roots.append(pathlib.Path(transformers.__file__).parent)
    total = 0
    for root in roots:
        for path in sorted(root.glob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            yield text
            total += len(text)
            if total >= _CORPUS_CAP_BYTES:
                return


def _build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        # Leave room for the added tags so the tokenizer fits the model's vocab.
        vocab_size=vocab_size - len(_ADDED),
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens([tokenizers.AddedToken(t, special=False) for t in _ADDED])
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer needs {tok.get_vocab_size()} > {vocab_size} ids")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hybrid_config(arch: str, vocab_size: int, shape: dict[str, int], ids: dict[str, int]):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape["hidden"],
        intermediate_size=2 * shape["hidden"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=64,
        max_position_embeddings=32768,
        initializer_range=0.5,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
    )
    if arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        layers = 6  # window, window, full, twice: three KV cache groups of two layers
        types = (["sliding_attention"] * 2 + ["full_attention"]) * (layers // 3)
        config = Gemma3TextConfig(
            num_hidden_layers=layers,
            sliding_window=GEMMA3_WINDOW,
            layer_types=types,
            dtype="float32",
            **common,
        )
        config.architectures = ["Gemma3ForCausalLM"]
        return config, Gemma3ForCausalLM, "float32"
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        num_hidden_layers=4,
        full_attention_interval=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        dtype="bfloat16",
        **common,
    )
    config.architectures = ["Qwen3NextForCausalLM"]
    return config, Qwen3NextForCausalLM, "bfloat16"


def _build(
    out: pathlib.Path, seed: int, vocab_size: int, shape: dict[str, int], arch: str = "llama"
) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIAL + _ADDED}
    if arch != "llama":
        config, model_cls, dtype = _hybrid_config(arch, vocab_size, shape, ids)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config).to(getattr(torch, dtype))
        _finish(model, tokenizer, ids, out)
        return
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape["hidden"],
        intermediate_size=2 * shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["hidden"] // shape["heads"],
        max_position_embeddings=32768,
        # Large init: at ~0.02 greedy decoding repeats one token, which would hide
        # KV-cache corruption; at 0.5 the output is varied and prompt-sensitive.
        initializer_range=0.5,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
        dtype="float32",
    )
    # fork_rng: seed locally without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    _finish(model, tokenizer, ids, out)


def _finish(model, tokenizer, ids: dict[str, int], out: pathlib.Path) -> None:
    import torch
    from transformers import GenerationConfig

    with torch.no_grad():
        # Zero logits for control/tag tokens: random logits have std ~8, so greedy
        # never picks them, and outputs run to max_tokens instead of stopping early.
        model.lm_head.weight[list(ids.values())] = 0.0
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS],
        # Stop at end of turn too, as ChatML models do.
        eos_token_id=[ids[EOS], ids[IM_END]],
        pad_token_id=ids[PAD],
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    vocab_size: int = 4096,
    shape: dict[str, int] | None = None,
    arch: str = "llama",
) -> pathlib.Path:
    """Build (or reuse) the tiny model in ``out_dir``; returns its absolute path."""
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not one of {ARCHS}")
    out = pathlib.Path(out_dir).resolve()
    shape = {**TINY_SHAPE, **(shape or {})}
    params = _params(seed, vocab_size, shape, arch)
    marker = out / _MARKER
    try:
        if json.loads(marker.read_text()) == params:
            return out  # The marker is written last, so it implies a complete build.
    except (OSError, ValueError):
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir, then os.replace file by file with the marker last:
    # concurrent builders (e.g. pytest-xdist) never expose a half-written model.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        _build(tmp, seed, vocab_size, shape, arch)
        out.mkdir(exist_ok=True)
        marker.unlink(missing_ok=True)
        for f in sorted(tmp.iterdir()):
            os.replace(f, out / f.name)
        marker.write_text(json.dumps(params, sort_keys=True) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or (len(args) == 2 and args[1] not in ARCHS):
        print(
            f"usage: python -m vllm_kvdisk.testing.tinymodel OUT_DIR [{'|'.join(ARCHS)}]",
            file=sys.stderr,
        )
        return 2
    print(build_tiny_model(args[0], arch=args[1] if len(args) == 2 else "llama"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
