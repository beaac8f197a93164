"""Synthetic set-ups for the core and storage tests: a byte-level token table, random
pages, a store with one namespace, and an index of files built from id arrays."""

from __future__ import annotations

import numpy as np

from vllm_kvdisk.core.encode import encode_plan
from vllm_kvdisk.core.entry import Entry, head_digest
from vllm_kvdisk.core.format import PageLayout, Reason
from vllm_kvdisk.core.index import Index
from vllm_kvdisk.core.keys import Fingerprint, token_digest
from vllm_kvdisk.core.planner import Planner, Prompt, SavePlan
from vllm_kvdisk.core.saverules import Grid
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.storage.store import Store

BLOCK = 16
LAYOUT = PageLayout("test:LBHNC", BLOCK, 2, (2, BLOCK, 8), "float32")
FP = Fingerprint("tiny", "main", "float32", LAYOUT.name, BLOCK, 1, 0)
GRID = Grid(64, 8, BLOCK)


def byte_table() -> TokenTable:
    """256 single bytes plus multi-byte pieces, including ones that are not valid UTF-8."""
    extra = [b"ab", "é".encode(), "日本".encode(), b"\xe2\x82", b"\xac", b" the"]
    return TokenTable([bytes([i]) for i in range(256)] + extra)


def prompt_of(ids) -> Prompt:
    return Prompt(byte_table(), ids)


def make(tmp_path, **kw) -> tuple[Store, str]:
    """A store under ``tmp_path/cache`` (1 GiB budget unless told) and FP's namespace."""
    kw.setdefault("space_bytes", 1 << 30)
    store = Store(str(tmp_path / "cache"), **kw)
    return store, store.ensure_namespace(FP)


def prompt(seed: int = 0, n: int = 400, vocab: int = 262) -> Prompt:
    """A prompt of ``n`` random tokens of ``byte_table`` below ``vocab`` (256: single bytes
    only)."""
    return prompt_of(np.random.default_rng(seed).integers(0, vocab, n))


def planner(store: Store) -> Planner:
    return Planner(store.index, BLOCK, store.read_ids, 1)


def pages(rng: np.random.Generator, plan: SavePlan, layout: PageLayout = LAYOUT) -> list[bytes]:
    nb = (plan.tokens - plan.parent_tokens) // layout.block_size
    return [
        rng.random((nb, *layout.page_shape), dtype=np.float32).tobytes()
        for _ in range(layout.num_layers)
    ]


def encode(
    plan: SavePlan,
    prompt: Prompt,
    layers,
    now: int = 1_000_000,
    tool_map=(),
    fp: Fingerprint = FP,
    compress: bool = False,
    layout: PageLayout = LAYOUT,
):
    return encode_plan(
        plan,
        text=prompt.text_upto(plan.tokens),
        ids=prompt.ids,
        layers=layers,
        layout=layout,
        fingerprint=fp.digest(),
        kv_dtype="float32",
        context_size=8192,
        now=now,
        tool_map=tool_map,
        compress=compress,
    )


def save(
    store: Store,
    ns: str,
    prompt: Prompt,
    length: int,
    rng: np.random.Generator,
    reason: Reason = Reason.COLD,
    now: int = 1_000_000,
    tool_map=(),
) -> tuple[SavePlan, list[bytes]]:
    plan = planner(store).plan_save(ns, prompt, length, reason)
    if plan is None:
        raise ValueError(f"nothing to save at {length}")
    layers = pages(rng, plan)
    store.write(ns, plan.sha1, encode(plan, prompt, layers, now, tool_map))
    return plan, layers


def child_of_a_root(tmp_path, seed: int):
    """A store with a root checkpoint at 48 tokens of ``prompt(seed)`` and the plan of its
    child at 112, not written yet: (store, ns, prompt, root plan, child plan, rng)."""
    store, ns = make(tmp_path)
    p = prompt(seed)
    rng = np.random.default_rng(0)
    root, _ = save(store, ns, p, 48, rng)
    plan = planner(store).plan_save(ns, p, 112, Reason.COLD)
    assert plan.parent == root.sha1
    return store, ns, p, root, plan, rng


# -- an index without files: entries built from id arrays --------------------------


def ids_of(seed: int, n: int = 400) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n).astype("<u4")


class Disk:
    """An index of files built from id arrays, with a reader of their stored ids."""

    def __init__(self):
        self.index = Index()
        self.stored: dict[str, np.ndarray] = {}
        self.reads = 0

    def add(
        self,
        name: str,
        ids: np.ndarray,
        end: int,
        parent: str | None = None,
        start: int = 0,
        ns: str = "n",
        size: int = 1000,
    ) -> Entry:
        e = Entry(
            ns,
            name,
            end,
            parent,
            start,
            Reason.COLD,
            0,
            0,
            0,
            size,
            token_digest(ids[:end]),
            head_digest(ids, start, BLOCK),
        )
        self.stored[name] = ids[:end].copy()
        self.index.add(e)
        return e

    def read(self, entry: Entry, start: int, stop: int):
        self.reads += 1
        return self.stored[entry.sha1][start:stop]

    def lookup(self, ids, limit=None, ns="n", include_pending=False, peers=None):
        return self.index.lookup(
            ns,
            ids,
            len(ids) if limit is None else limit,
            BLOCK,
            self.read,
            include_pending=include_pending,
            peers=peers,
        )
