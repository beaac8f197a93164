"""Which model a checkpoint belongs to: a cheap identity of the weights themselves.

A checkpoint restored into another model is wrong answers, not a miss, so the namespace
carries the model's identity, not just its name:

* a local directory: a digest of ``config.json``, every weight file's name and size, each
  safetensors header (tensor names, shapes, dtypes, offsets), and 64 KiB samples of each
  weight file's data at eight fixed offsets: a fine-tune saved to the same path with the
  same config and shapes changes the samples. Reads about 0.5 MiB per weight file.
* a hub model: the commit its files were downloaded at (the snapshot directory in the
  local Hugging Face cache), or the revision the user pinned.

Pure: standard library only (the hub cache is read from disk, never the network).
"""

from __future__ import annotations

import hashlib
import os
import struct

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
SAMPLES = 8
SAMPLE_BYTES = 64 << 10
MAX_SAFETENSORS_HEADER = 100 << 20


def _weight_files(directory: str) -> list[str]:
    names = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(WEIGHT_SUFFIXES) and os.path.isfile(path):
            names.append(name)
    return names


def _safetensors_header(fd: int, size: int) -> tuple[bytes, int]:
    """The JSON header and where the data starts (0, 0 if it is not a safetensors file)."""
    raw = os.pread(fd, 8, 0)
    if len(raw) != 8:
        return b"", 0
    (length,) = struct.unpack("<Q", raw)
    if not 0 < length <= min(MAX_SAFETENSORS_HEADER, size - 8):
        return b"", 0
    return os.pread(fd, length, 8), 8 + length


def weights_digest(directory: str) -> str:
    """16 hex digits that change when the weights in ``directory`` change."""
    h = hashlib.sha256()
    config = os.path.join(directory, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as fh:
            h.update(b"config\0" + fh.read())
    for name in _weight_files(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            h.update(f"\0{name}\0{size}\0".encode())
            data_at = 0
            if name.endswith(".safetensors"):
                header, data_at = _safetensors_header(fd, size)
                h.update(header)
            span = size - data_at
            for i in range(SAMPLES):
                at = data_at + (span * i) // SAMPLES
                h.update(os.pread(fd, min(SAMPLE_BYTES, max(0, size - at)), at))
        finally:
            os.close(fd)
    return h.hexdigest()[:16]


def hub_commit(model_id: str, revision: str | None, cache_dir: str | None = None) -> str | None:
    """The commit of a hub model's files in the local Hugging Face cache, if there."""
    cache = (
        cache_dir
        or os.environ.get("HF_HUB_CACHE")
        or os.path.join(
            os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
        )
    )
    repo = os.path.join(cache, "models--" + model_id.replace("/", "--"))
    ref = revision or "main"
    ref_file = os.path.join(repo, "refs", ref)
    if os.path.isfile(ref_file):
        with open(ref_file) as fh:
            return fh.read().strip() or None
    if revision and os.path.isdir(os.path.join(repo, "snapshots", revision)):
        return revision
    return None


def model_identity(model: str, revision: str | None) -> tuple[str, str]:
    """(model name, identity) for a namespace: a weights digest for a local directory, the
    commit for a hub model (or the pinned revision when the cache cannot tell)."""
    if os.path.isdir(model):
        return model, "weights-" + weights_digest(model)
    commit = hub_commit(model, revision)
    if commit:
        return model, "commit-" + commit
    return model, str(revision or "")
