"""Which model a checkpoint belongs to: an identity of the weights, or the hub commit."""

import json
import os

from vllm_kvdisk.core.identity import model_identity, weights_digest


def test_a_fine_tune_saved_over_the_same_path_is_another_namespace(tmp_path):
    """Same config, same shapes, other weights: before, the namespace was a digest of
    config.json only, and the old model's checkpoints would have been restored."""
    import struct

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 18], "data_offsets": [0, 1 << 20]}})
    blob = struct.pack("<Q", len(header)) + header.encode()

    def weights(fill: bytes) -> None:
        (model / "model.safetensors").write_bytes(blob + fill * (1 << 20))

    weights(b"\x01")
    before = weights_digest(str(model))
    assert weights_digest(str(model)) == before  # stable
    weights(b"\x02")  # fine-tuned: every weight moved, nothing else did
    assert weights_digest(str(model)) != before
    assert model_identity(str(model), None)[1].startswith("weights-")
    hub = tmp_path / "hub" / "models--org--m" / "refs"
    hub.mkdir(parents=True)
    (hub / "main").write_text("abc123\n")
    os.environ["HF_HUB_CACHE"] = str(tmp_path / "hub")
    try:
        assert model_identity("org/m", None) == ("org/m", "commit-abc123")
    finally:
        del os.environ["HF_HUB_CACHE"]
