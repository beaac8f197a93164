"""Turn-level replay against chat templates that behave like real ones.

Each template below re-renders an assistant tool-call turn in its own way (a newline
before the first call, content then calls, separators between calls, JSON re-serialised
with other spacing and key order, Llama-3.x ``parameters`` JSON, Mistral ``[TOOL_CALLS]``
with ids and a space before plain content, a DSML block). In each, the prompt of the next
request must start with the earlier prompt followed by the turn exactly as it was
sampled, token for token, so the cache hit reaches past the whole turn. Rendering is
Jinja as Hugging Face's ``apply_chat_template`` does it; tokens are characters here (the
splice tokenizes each piece on its own, so that is what is checked).
"""

import json

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vllm_kvdisk.replay.memory import ToolMemory, ToolRecord, prefix_digest
from vllm_kvdisk.replay.messages import make_signature
from vllm_kvdisk.replay.turns import (
    PrefixMismatch,
    plan_replay,
    sentinel_messages,
    splice,
    turn_opening,
)

HERMES = (  # Qwen2.5 / Hermes: a newline before each call, none after the header if no content
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{% if m.content %}\n{{ m.content }}{% endif %}"
    '{% for tc in m.tool_calls %}\n<tool_call>\n{"name": "{{ tc.function.name }}", '
    '"arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (  # Llama 3.x: a JSON object with "parameters", content trimmed
    "<|begin_of_text|>{% for m in messages %}"
    "<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    '{% if m.tool_calls %}{% for tc in m.tool_calls %}{"name": "{{ tc.function.name }}", '
    '"parameters": {{ tc.function.arguments | tojson }}}{% endfor %}'
    "{% else %}{{ m.content | trim }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL = (  # Mistral: [TOOL_CALLS] with ids; plain content gets a leading space
    "<s>{% for m in messages %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}, "
    '"call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]'
    "{% elif m.tool_calls %}[TOOL_CALLS] [{% for tc in m.tool_calls %}"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, '
    '"id": "{{ tc.id }}"}{{ \', \' if not loop.last }}{% endfor %}]</s>'
    "{% else %} {{ m.content }}</s>{% endif %}{% endfor %}"
)
DSML = (  # a DSML block (DeepSeek V3.2 style): parameters as tags, no JSON at all
    "<｜begin▁of▁sentence｜>{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% else %}<｜Assistant｜></think>{{ m.content or '' }}"
    "{% if m.tool_calls %}\n\n<｜DSML｜function_calls>{% for tc in m.tool_calls %}\n"
    '<｜DSML｜invoke name="{{ tc.function.name }}">'
    '{% for k, v in tc.function.arguments | dictsort %}\n<｜DSML｜parameter name="{{ k }}" '
    'string="true">{{ v }}</｜DSML｜parameter>{% endfor %}\n</｜DSML｜invoke>{% endfor %}\n'
    "</｜DSML｜function_calls>{% endif %}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)

ROME = {"unit": "c", "city": "Rome"}
PARIS = {"city": "Paris", "unit": "c"}
# (template, content the model wrote, calls, the turn exactly as sampled)
CASES = {
    "newline before the first call": (
        HERMES,
        None,
        [ROME],
        '<tool_call>\n{"name":"get_weather","arguments":{"unit":"c","city":"Rome"}}\n</tool_call>',
    ),
    "content then calls": (
        HERMES,
        "Let me check.",
        [ROME],
        'Let me check.\n\n<tool_call>{"arguments": {"city": "Rome", "unit": "c"}, '
        '"name": "get_weather"}</tool_call>',
    ),
    "several calls with separators": (
        HERMES,
        None,
        [ROME, PARIS],
        '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "city": "Rome"}}\n'
        '</tool_call>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
        ' "unit": "c"}}\n</tool_call>',
    ),
    "llama-3.x parameters json": (
        LLAMA3,
        None,
        [ROME],
        '{"name": "get_weather", "parameters": {"unit":"c", "city":"Rome"}}',
    ),
    "mistral tool_calls with ids": (
        MISTRAL,
        None,
        [ROME, PARIS],
        '[TOOL_CALLS][{"name":"get_weather","arguments":{"unit":"c","city":"Rome"},'
        '"id":"a1B2c3D4e"},{"name":"get_weather","arguments":{"city":"Paris","unit":"c"},'
        '"id":"f5G6h7I8j"}]',
    ),
    "dsml block": (
        DSML,
        None,
        [ROME],
        '\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="unit" string="true">c</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
    ),
}
IDS = ["a1B2c3D4e", "f5G6h7I8j"]
# The syntax each template's tool parser declares (vLLM's parsers: ``*_token`` attributes).
MARKUP = {
    HERMES: ["<tool_call>", "</tool_call>", "<|im_end|>"],
    LLAMA3: ["<|python_tag|>", "<|eot_id|>"],
    MISTRAL: ["[TOOL_CALLS]", "</s>"],
    DSML: [
        "<｜DSML｜function_calls>",
        "</｜DSML｜function_calls>",
        '<｜DSML｜invoke name="',
        "</｜DSML｜invoke>",
        '<｜DSML｜parameter name="',
        'string="true"',
        "</｜DSML｜parameter>",
    ],
}


def render(template: str, messages: list, add_generation_prompt: bool) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    calls_as_dicts = []
    for m in messages:  # the renderer json-loads arguments before the template runs
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **tc,
                    "function": {
                        **tc["function"],
                        "arguments": json.loads(tc["function"]["arguments"]),
                    },
                }
                for tc in m["tool_calls"]
            ]
        calls_as_dicts.append(m)
    return env.from_string(template).render(
        messages=calls_as_dicts, add_generation_prompt=add_generation_prompt
    )


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def conversation(content, calls):
    first = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Weather in Rome and Paris?"},
    ]
    turn = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": IDS[k],
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(args)},
            }
            for k, args in enumerate(calls)
        ],
    }
    results = [
        {"role": "tool", "tool_call_id": IDS[k], "content": f"{20 + k} C"}
        for k in range(len(calls))
    ]
    return first, first + [turn] + results


def replayed(template: str, messages: list, memory: ToolMemory, with_opening: bool = True):
    plan = plan_replay(messages, memory, sign=lambda r: None, markup=MARKUP[template])
    swapped, sentinels = sentinel_messages(messages, plan.replays)
    text = render(template, swapped, add_generation_prompt=True)
    opening = None
    if with_opening:
        user = [{"role": "user", "content": "q"}]
        opening = turn_opening(
            render(template, user, True),
            render(template, user + [{"role": "assistant", "content": sentinels[0]}], False),
            sentinels[0],
        )
    return plan, splice(text, sentinels, plan.replays, encode, opening)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_whole_turn_renders_exactly_as_sampled(case):
    template, content, calls, sampled = CASES[case]
    first, messages = conversation(content, calls)
    prompt1 = render(template, first, add_generation_prompt=True)  # what the model saw
    memory = ToolMemory(10)
    record = ToolRecord(
        sampled,
        tuple(encode(sampled)),
        make_signature(content, [("get_weather", json.dumps(a)) for a in calls]),
        prefix=prefix_digest(encode(prompt1)),
    )
    for tid in IDS[: len(calls)]:
        memory.put("", tid, record)
    as_usual = render(template, messages, add_generation_prompt=True)
    assert not as_usual.startswith(prompt1 + sampled)  # the template alone loses the hit
    plan, (ids, text) = replayed(template, messages, memory)
    assert len(plan.replays) == 1 and not plan.notes
    assert text.startswith(prompt1 + sampled)
    assert ids[: len(prompt1) + len(sampled)] == encode(prompt1) + list(record.token_ids)
    assert ids == encode(text) and "20 C" in text[len(prompt1) + len(sampled) :]


def test_mistrals_space_before_content_needed_the_turn_opening():
    """Mistral writes ' ' + content for a plain assistant message but nothing after
    [/INST] when it samples: splicing where the content goes left a space the model never
    saw, and the hit stopped at the earlier prompt."""
    template, content, calls, sampled = CASES["mistral tool_calls with ids"]
    first, messages = conversation(content, calls)
    prompt1 = render(template, first, add_generation_prompt=True)
    memory = ToolMemory(10)
    record = ToolRecord(
        sampled,
        tuple(encode(sampled)),
        make_signature(content, [("get_weather", json.dumps(a)) for a in calls]),
        prefix=prefix_digest(encode(prompt1)),
    )
    for tid in IDS:
        memory.put("", tid, record)
    with pytest.raises(PrefixMismatch):  # the space is not in the prompt it was sampled after
        replayed(template, messages, memory, with_opening=False)
    record.prefix = prefix_digest(encode(prompt1 + " "))
    _, (_, without) = replayed(template, messages, memory, with_opening=False)
    assert without.startswith(prompt1 + " " + sampled)
    record.prefix = prefix_digest(encode(prompt1))
    _, (_, with_opening) = replayed(template, messages, memory)
    assert with_opening.startswith(prompt1 + sampled)


def test_a_partly_known_turn_renders_as_the_template_does_and_says_why():
    template, content, calls, sampled = CASES["several calls with separators"]
    _, messages = conversation(content, calls)
    memory = ToolMemory(10)
    memory.put(
        "",
        IDS[0],
        ToolRecord(
            sampled,
            tuple(encode(sampled)),
            make_signature(content, [("get_weather", json.dumps(a)) for a in calls]),
            prefix=bytes(32),
        ),
    )
    plan = plan_replay(messages, memory, sign=lambda r: None)
    assert not plan.replays and plan.notes == ["message 2: 1 of 2 call(s) unknown"]
    assert plan.summary().endswith("(as the template renders: message 2: 1 of 2 call(s) unknown)")
    memory.put("", IDS[1], memory.get("", IDS[0]))
    messages[2]["tool_calls"][1]["function"]["arguments"] = json.dumps({"city": "Oslo"})
    plan = plan_replay(messages, memory, sign=lambda r: None)
    assert not plan.replays and plan.notes == ["message 2: it differs from what was sampled"]
