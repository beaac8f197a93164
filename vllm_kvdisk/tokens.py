"""Build the token -> exact bytes table from a Hugging Face style tokenizer.

Two vocabularies cover nearly all open models and both are exact:
* byte-level BPE (GPT-2, Llama 3, Qwen, DeepSeek): each character of a token string stands
  for one byte through GPT-2's printable byte alphabet;
* SentencePiece (Llama 2, Mistral, Gemma): ``▁`` is a space and ``<0xNN>`` pieces are raw
  bytes (byte fallback).
Added and special tokens render as their literal UTF-8 content. Pure: takes any object with
``convert_ids_to_tokens`` and ``len()``; no vLLM, no torch.
"""

from __future__ import annotations

import re
from typing import Any

from vllm_kvdisk.keys import TokenTable

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_byte_decoder() -> dict[str, int]:
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
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
    raise ValueError("tokenizer is neither byte-level BPE nor SentencePiece; "
                     "kvdisk cannot render its tokens to exact bytes")


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
            out.append(bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode())
    return TokenTable(out)
