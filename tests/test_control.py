"""Per-request control from kv_transfer_params: parsed with bounds, never an error."""

from types import SimpleNamespace

from vllm_kvdisk.control import MAX_TOOL_PAIRS, RequestControl, tool_entries


def req(params):
    return SimpleNamespace(kv_transfer_params=params)


def test_load_save_and_cap_are_read_and_bad_values_ignored():
    assert RequestControl.from_request(req(None)) == RequestControl()
    got = RequestControl.from_request(req({"kvdisk": {"load": False, "save": False,
                                                      "max_save_tokens": 4096}}))
    assert (got.load, got.save, got.max_save_tokens) == (False, False, 4096)
    odd = RequestControl.from_request(req({"kvdisk": {"load": "no", "max_save_tokens": -5,
                                                      "save": 0, "x": 1}}))
    assert odd == RequestControl()  # wrong types and unknown keys change nothing
    assert RequestControl.from_request(req({"kvdisk": [1, 2]})) == RequestControl()
    assert RequestControl.from_request(SimpleNamespace()) == RequestControl()
    # Images (or embeddings) behind placeholder tokens: the ids do not say what they are.
    image = SimpleNamespace(kv_transfer_params=None, mm_features=[object()])
    assert RequestControl.from_request(image) == RequestControl(load=False, save=False)


def test_tool_entries_are_bounded_and_must_be_in_the_checkpoint():
    text = b"<tool_call>A</tool_call> and <tool_call>B</tool_call>"
    pairs = [["a", "<tool_call>A</tool_call>"], ["b", "<tool_call>B</tool_call>"],
             ["c", "not in the text"], ["", "<tool_call>A</tool_call>"], [1, "x"], "junk"]
    assert tool_entries(req({"kvdisk_tool_map": pairs}), text) == [
        ("a", "<tool_call>A</tool_call>"), ("b", "<tool_call>B</tool_call>")]
    hostile = [[f"id{i}", "<tool_call>A</tool_call>"] for i in range(1 << 20)]
    assert len(tool_entries(req({"kvdisk_tool_map": hostile}), text)) == MAX_TOOL_PAIRS
    big = [["z", "<tool_call>A</tool_call>"], ["x", "y" * (1 << 19)],
           ["w", "<tool_call>B</tool_call>"]]  # past the byte budget nothing more is read
    assert tool_entries(req({"kvdisk_tool_map": big}), text) == [("z", "<tool_call>A</tool_call>")]
