"""The token table, token id -> exact bytes, and its builder from a tokenizer.

* The rendered text of ``tokens[0:L]`` is the concatenation of each token's bytes, from a
  table built once from the tokenizer. It is raw bytes: a prefix may end in the middle of
  a UTF-8 character, so it is hashed and stored as bytes, never re-encoded. A token id the
  table does not know (padded vocabularies sample them) renders as U+FFFD: the text is a
  name and a preview, identity is always the token ids.

The builder takes a Hugging Face style tokenizer. Two vocabularies cover nearly all open
models and both are exact:
* byte-level BPE (GPT-2, Llama 3, Qwen, DeepSeek): each character of a token string stands
  for one byte through GPT-2's printable byte alphabet;
* SentencePiece (Llama 2, Mistral, Gemma): ``▁`` is a space and ``<0xNN>`` pieces are raw
  bytes (byte fallback).
Added and special tokens render as their literal UTF-8 content. Pure: takes any object with
``convert_ids_to_tokens`` and ``len()``; no vLLM, no torch (numpy and xxhash for the
table).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash


class TokenTable:
    """token id -> exact bytes, flattened so a prompt renders without a Python loop."""

    __slots__ = ("_blob", "_starts", "_lengths", "_size")

    UNKNOWN = "\ufffd".encode()  # what a detokenizer shows for an id it does not know

    def __init__(self, pieces: Sequence[bytes]):
        # One extra slot at the end renders ids outside the vocabulary.
        pieces = list(pieces) + [self.UNKNOWN]
        self._size = len(pieces) - 1
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        self._lengths = lengths
        self._starts = np.zeros(len(pieces), dtype=np.int64)
        np.cumsum(lengths[:-1], out=self._starts[1:])
        self._blob = np.frombuffer(b"".join(pieces), dtype=np.uint8)

    def __len__(self) -> int:
        return self._size

    def digest(self) -> str:
        """Identity of the vocabulary (what the tool-call log scopes its records by)."""
        h = xxhash.xxh3_128()
        h.update(self._lengths.tobytes())
        h.update(self._blob.tobytes())
        return h.hexdigest()

    def piece(self, token: int) -> bytes:
        token = token if 0 <= token < self._size else self._size
        start = int(self._starts[token])
        return self._blob[start : start + int(self._lengths[token])].tobytes()

    def render(self, tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Text of ``tokens`` and the byte offset where each token ends."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self._size):
            tokens = np.where((tokens < 0) | (tokens >= self._size), self._size, tokens)
        lengths = self._lengths[tokens]
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if tokens.size else 0
        if total == 0:
            return b"", ends
        # Gather variable-length pieces: index = start of its token + offset inside it.
        shift = self._starts[tokens] - (ends - lengths)
        index = np.arange(total, dtype=np.int64) + np.repeat(shift, lengths)
        return self._blob[index].tobytes(), ends


_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_byte_decoder() -> dict[str, int]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_DECODER = _gpt2_byte_decoder()


def _special_ids(tokenizer: Any) -> dict[int, str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): getattr(t, "content", str(t)) for i, t in decoder.items()}


def detect_kind(pieces: list[str | None]) -> str:
    sample = [p for p in pieces if p][:5000]
    if any(p.startswith("▁") for p in sample) or any(_BYTE_PIECE.match(p) for p in sample):
        return "sentencepiece"
    if all(all(ch in _BYTE_DECODER for ch in p) for p in sample):
        return "bytelevel"
    raise ValueError(
        "tokenizer is neither byte-level BPE nor SentencePiece; "
        "kvdisk cannot render its tokens to exact bytes"
    )


def table_from_tokenizer(tokenizer: Any) -> TokenTable:
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = _special_ids(tokenizer)
    kind = detect_kind([p for i, p in enumerate(pieces) if i not in special])
    out: list[bytes] = []
    for i, piece in enumerate(pieces):
        if i in special:
            out.append(special[i].encode())
        elif piece is None:
            out.append(b"")
        elif kind == "bytelevel":
            try:
                out.append(bytes(_BYTE_DECODER[ch] for ch in piece))
            except KeyError:  # an added non-special token stored as plain text
                out.append(piece.encode())
        else:
            match = _BYTE_PIECE.match(piece)
            out.append(
                bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode()
            )
    return TokenTable(out)
