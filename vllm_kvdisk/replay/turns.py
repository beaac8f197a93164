"""Which assistant turns of a request replay, and the prompt with their sampled ids in.

An assistant message is replayed only if every one of its tool-call ids is known **in the
request's own tenant** (LoRA adapter and cache salt), all point to one record, the message
equals what the model produced (same names, JSON-equal arguments, same content; no
reasoning), and the sampled turn says nothing the client did not receive
(:func:`~vllm_kvdisk.replay.messages.hidden_text` is empty). The message is then rendered
with a sentinel as its only content and the sentinel is replaced by the sampled token ids,
but only where the prompt before it is exactly the prompt the turn was sampled after (its
token ids hash to the record's prefix digest), so the prompt equals prompt + sampled tokens
of the earlier turn token for token. Anything else renders as usual: an id sent back with
other arguments, by another tenant, or after another prompt is never replayed.

Invariants: replay never changes what a client's message says, only how the same message
is tokenized; it never inserts a record of another tenant, nor one after a prompt it was
not sampled after (a record without a prefix digest never replays); nothing here raises
out of a lookup. Pure: no vLLM, no torch.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_kvdisk.replay.memory import PREFIX_SEED, ToolMemory, ToolRecord
from vllm_kvdisk.replay.messages import (
    Signature,
    hidden_text,
    message_signature,
    message_tool_ids,
)


@dataclass(slots=True)
class Replay:
    index: int  # position of the assistant message in the request's messages
    ids: list[str]
    record: ToolRecord


@dataclass(slots=True)
class Plan:
    replays: list[Replay] = field(default_factory=list)
    from_memory: int = 0
    from_disk: int = 0
    missing: int = 0
    changed: int = 0
    fallback: str | None = None  # why rendering did not use the plan
    notes: list[str] = field(default_factory=list)  # why a turn renders as the template does

    def summary(self) -> str:
        if self.fallback:
            line = (
                f"none (rendered as usual: {self.fallback}); "
                f"{self.missing} missing, {self.changed} changed"
            )
        else:
            line = (
                f"{self.from_memory} from memory, {self.from_disk} from disk, "
                f"{self.missing} missing, {self.changed} changed"
            )
        if self.notes:  # bounded: a long conversation says its first reasons only
            more = f"; +{len(self.notes) - 3} more" if len(self.notes) > 3 else ""
            line += " (as the template renders: " + "; ".join(self.notes[:3]) + more + ")"
        return line

    def tool_map(self) -> list[list[str]]:
        return [[tid, r.record.text] for r in self.replays for tid in r.ids]

    def drop_from(self, k: int, why: str) -> None:
        """Turns ``k``.. render as usual: turn ``k`` for ``why``, the later ones because
        they were sampled after turn ``k`` as it was replayed."""
        for j, replay in enumerate(self.replays[k:]):
            if replay.record.origin == "disk":
                self.from_disk -= len(replay.ids)
            else:
                self.from_memory -= len(replay.ids)
            self.changed += len(replay.ids)
            self.notes.append(
                f"message {replay.index}: "
                + (why if j == 0 else "an earlier turn renders as usual")
            )
        del self.replays[k:]


def plan_replay(
    messages: Sequence[Any],
    memory: ToolMemory,
    sign: Callable[[ToolRecord], Signature | None],
    tenant: str = "",
    markup: Iterable[str] = (),
) -> Plan:
    """Which assistant messages of a request of ``tenant`` can be replayed. ``sign`` parses
    a disk record's text into the message the client would have seen (None if it cannot);
    ``markup``: strings of the tool-call syntax that the client is not shown (the parser's
    tags, the tokenizer's special tokens)."""
    plan = Plan()
    markup = tuple(markup)
    for index, message in enumerate(messages):
        ids = message_tool_ids(message)
        if not ids:
            continue
        records = [memory.get(tenant, tid) for tid in ids]
        known = [r for r in records if r is not None]
        plan.missing += len(ids) - len(known)
        if len(known) < len(ids):
            plan.changed += len(known)
            plan.notes.append(
                f"message {index}: {len(ids) - len(known)} of {len(ids)} call(s) unknown"
            )
            continue
        record = known[0]
        same = all(r is record or r.text == record.text for r in known)
        if same and record.signature is None:
            record.signature = sign(record)
        why = (
            "its calls come from different turns"
            if not same
            else "its sampled text could not be parsed"
            if record.signature is None
            else "it has reasoning"
            if record.signature.reasoning
            else "it differs from what was sampled"
            if record.signature != message_signature(message)
            else "its sampled turn holds text the client did not receive"
            if _hides(record, record.signature, ids, markup)
            else "the prompt it was sampled after is unknown"
            if record.prefix is None and record.source is None
            else None
        )
        if why is not None:
            plan.changed += len(ids)
            plan.notes.append(f"message {index}: {why}")
            continue
        if record.origin == "disk":
            plan.from_disk += len(ids)
        else:
            plan.from_memory += len(ids)
        plan.replays.append(Replay(index, ids, record))
    return plan


def _hides(
    record: ToolRecord, signature: Signature, ids: list[str], markup: tuple[str, ...]
) -> bool:
    """Whether the record says more than a message with ``ids`` carries (computed once per
    record and ids: the check is linear in its text)."""
    key = tuple(ids)
    if record.hidden is None or record.hidden[0] != key:
        record.hidden = (key, bool(hidden_text(record.text, signature, ids, markup)))
    return record.hidden[1]


def sentinel_messages(
    messages: Sequence[Any], replays: Sequence[Replay]
) -> tuple[list[Any], list[str]]:
    """The messages with each replayed assistant message reduced to a unique sentinel as
    its content (alphanumeric, so no template escapes or trims it)."""
    nonce = uuid.uuid4().hex
    out = list(messages)
    sentinels = []
    for k, replay in enumerate(replays):
        token = f"KVDISKREPLAY{nonce}X{k}Z"
        sentinels.append(token)
        out[replay.index] = {"role": "assistant", "content": token}
    return out, sentinels


@dataclass(frozen=True, slots=True)
class TurnOpening:
    """How the chat template opens an assistant turn. ``generation``: after the generation
    prompt, where the model started sampling; ``content``: before the content of a plain
    assistant message (where a sentinel lands). Templates differ here: a space before
    content (Mistral), a newline only when content is not empty, trimmed headers."""

    generation: str
    content: str


def turn_opening(with_generation: str, with_content: str, sentinel: str) -> TurnOpening | None:
    """From two renders of one user message: with the generation prompt, and followed by
    an assistant message whose content is ``sentinel``. None if the sentinel is not there."""
    at = with_content.find(sentinel)
    if at < 0:
        return None
    before = with_content[:at]
    common = 0
    for a, b in zip(with_generation, before):
        if a != b:
            break
        common += 1
    return TurnOpening(with_generation[common:], before[common:])


class PrefixMismatch(Exception):
    """The prompt before replayed turn ``index`` is not the one it was sampled after."""

    def __init__(self, index: int):
        super().__init__(f"turn {index} was sampled after another prompt")
        self.index = index


def splice(
    text: str,
    sentinels: Sequence[str],
    replays: Sequence[Replay],
    encode: Callable[[str], list[int]],
    opening: TurnOpening | None = None,
) -> tuple[list[int], str] | None:
    """Token ids and text of the rendered prompt with each sentinel replaced by the
    replayed turn, exactly as sampled: content, whitespace, every call and the text
    between calls. With ``opening``, the template's content opening before each sentinel
    becomes its generation prompt, so the text before a turn is exactly the prompt the
    model sampled it after. Each piece between sentinels is tokenized on its own: the
    first is exactly the earlier turn's prompt, which vLLM tokenized on its own too. None
    if a sentinel is missing, repeated or out of order, or a turn does not open as
    ``opening`` says (the template did something else). Raises :class:`PrefixMismatch`
    for the first turn whose prompt before it does not hash to its record's prefix."""
    ids: list[int] = []
    parts: list[str] = []
    pos = 0
    prefix = hashlib.sha256(PREFIX_SEED)
    hashed = 0
    for k, (token, replay) in enumerate(zip(sentinels, replays)):
        at = text.find(token, pos)
        if at < 0 or text.count(token) != 1:
            return None
        piece = text[pos:at]
        if opening is not None and opening.content != opening.generation:
            if not piece.endswith(opening.content):
                return None
            piece = piece[: len(piece) - len(opening.content)] + opening.generation
        ids += encode(piece) if piece else []
        prefix.update(np.asarray(ids[hashed:], dtype=np.int64).astype("<u4").tobytes())
        hashed = len(ids)
        if replay.record.prefix is None or prefix.digest() != replay.record.prefix:
            raise PrefixMismatch(k)
        parts += [piece, replay.record.text]
        tokens = replay.record.token_ids
        ids += list(tokens) if tokens is not None else encode(replay.record.text)
        pos = at + len(token)
    tail = text[pos:]
    ids += encode(tail) if tail else []
    parts.append(tail)
    return ids, "".join(parts)
