"""Per-request control from kv_transfer_params: parsed with bounds, never an error."""

from types import SimpleNamespace

from vllm_kvdisk.core.control import MAX_SAVE_TOKENS, MAX_TOOL_PAIRS, RequestControl, tool_entries


def req(params):
    return SimpleNamespace(kv_transfer_params=params)


def entries(params, text: bytes) -> list[tuple[str, str]]:
    return tool_entries(RequestControl.from_request(req(params)), text)


def test_load_save_and_cap_are_read_and_bad_values_ignored():
    assert RequestControl.from_request(req(None)) == RequestControl()
    got = RequestControl.from_request(
        req({"kvdisk": {"load": False, "save": False, "max_save_tokens": 4096}})
    )
    assert (got.load, got.save, got.max_save_tokens) == (False, False, 4096)
    odd = RequestControl.from_request(
        req({"kvdisk": {"load": "no", "max_save_tokens": -5, "save": 0, "x": 1}})
    )
    assert odd == RequestControl()  # wrong types and unknown keys change nothing
    assert RequestControl.from_request(req({"kvdisk": [1, 2]})) == RequestControl()
    assert RequestControl.from_request(SimpleNamespace()) == RequestControl()
    # Images (or embeddings) behind placeholder tokens: the ids do not say what they are.
    image = SimpleNamespace(kv_transfer_params=None, mm_features=[object()])
    assert RequestControl.from_request(image) == RequestControl(load=False, save=False)


def test_tool_entries_are_bounded_and_must_be_in_the_checkpoint():
    text = b"<tool_call>A</tool_call> and <tool_call>B</tool_call>"
    pairs = [
        ["a", "<tool_call>A</tool_call>"],
        ["b", "<tool_call>B</tool_call>"],
        ["c", "not in the text"],
        ["", "<tool_call>A</tool_call>"],
        [1, "x"],
        "junk",
    ]
    assert entries({"kvdisk_tool_map": pairs}, text) == [
        ("a", "<tool_call>A</tool_call>"),
        ("b", "<tool_call>B</tool_call>"),
    ]
    hostile = [[f"id{i}", "<tool_call>A</tool_call>"] for i in range(1 << 20)]
    assert len(entries({"kvdisk_tool_map": hostile}, text)) == MAX_TOOL_PAIRS
    big = [
        ["z", "<tool_call>A</tool_call>"],
        ["x", "y" * (1 << 19)],
        ["w", "<tool_call>B</tool_call>"],
    ]  # past the byte budget nothing more is read
    assert entries({"kvdisk_tool_map": big}, text) == [("z", "<tool_call>A</tool_call>")]


# -- hostile clients -----------------------------------------------------------------------
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_kvdisk.core.toolmap import encode_tool_map  # noqa: E402

# Any code point, lone surrogates included: "\ud800" is valid JSON and reaches the engine.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
HUGE = st.integers(-1, 1).map(lambda sign: sign * 10**5000)  # past str()'s digit limit
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | HUGE
    | st.floats()
    | ANY_TEXT
    | st.sampled_from(["\ud800", "\udfff", "a\ud800b"])
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=16,
)
PAIRS = st.lists(
    st.lists(ANY_TEXT, min_size=2, max_size=2) | st.tuples(ANY_TEXT, ANY_TEXT) | JSON, max_size=8
)
CONTROL = st.dictionaries(
    st.sampled_from(["load", "save", "max_save_tokens"]) | ANY_TEXT, JSON, max_size=5
)
PARAMS = st.fixed_dictionaries(
    {}, optional={"kvdisk": CONTROL | JSON, "kvdisk_tool_map": PAIRS | JSON, "client": JSON}
)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@settings(max_examples=400, deadline=None)
@given(params=PARAMS | JSON)
@example(params={"kvdisk_tool_map": [["\ud800", "<call>"]]})
@example(params={"kvdisk_tool_map": [["id", "<call \udfff>"]]})
@example(params={"kvdisk": {"max_save_tokens": 1 << 41, "\ud800": -1}})
def test_every_client_field_is_parsed_with_bounds_and_never_raises(params):
    """Whatever a client puts in kv_transfer_params, parsing never raises and all it keeps
    is usable as is: pairs that encode to UTF-8 within the KTM limits, a bounded cap."""
    check_parsed(params)


def test_deep_nesting_and_huge_numbers_are_ignored_not_fatal():
    # (Outside hypothesis: its report of such a value would itself fail.)
    for params in (
        {
            "kvdisk": {"load": nested(50_000), "x": nested(50_000)},
            "kvdisk_tool_map": nested(50_000),
        },
        {"kvdisk": {"max_save_tokens": 10**5000, "save": -(10**5000)}},
        {"kvdisk": nested(50_000)},
    ):
        assert check_parsed(params) == RequestControl()


def check_parsed(params) -> RequestControl:
    control = RequestControl.from_request(req(params))
    assert isinstance(control.load, bool) and isinstance(control.save, bool)
    cap = control.max_save_tokens
    assert cap is None or (type(cap) is int and 0 <= cap <= MAX_SAVE_TOKENS)
    assert len(control.tool_pairs) <= MAX_TOOL_PAIRS
    text = b"|".join(p.raw_text for p in control.tool_pairs)
    entries = tool_entries(control, text)
    assert entries == [(p.id, p.text) for p in control.tool_pairs]
    encode_tool_map(entries)  # what the worker writes into the checkpoint: never fails
    return control


def test_a_pin_is_read_within_its_bounds_and_bad_ones_ignored():
    from vllm_kvdisk.core.control import MAX_PIN_S

    def pin(value):
        return RequestControl.from_request(req({"kvdisk": {"pin_s": value}})).pin_s

    assert pin(3600) == 3600 and pin(MAX_PIN_S) == MAX_PIN_S
    assert pin(MAX_PIN_S + 1) == pin(0) == pin(-5) == pin(True) == pin("60") == pin(1.5) == 0
    assert RequestControl.from_request(req(None)).pin_s == 0
