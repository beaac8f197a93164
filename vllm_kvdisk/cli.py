"""``kvdisk``: look into and maintain a cache directory without vLLM or torch.

    kvdisk ls DIR            one line per checkpoint
    kvdisk inspect FILE      every header field, layout, chain, text preview
    kvdisk verify DIR [--fix]
    kvdisk gc DIR --to-mb N
    kvdisk stats DIR

Tables by default, ``--json`` for scripts. Exit 0 when all is well, 1 when ``verify`` found
problems, 2 on bad input (with a message on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Sequence

from vllm_kvdisk.format import (DTYPE_NAMES, FLAG_DELTA, FLAG_TOOL_MAP, FormatError, read_meta,
                                read_tool_map)
from vllm_kvdisk.index import Entry
from vllm_kvdisk.store import KV_NAME, Store
from vllm_kvdisk.verify import verify


class UsageError(Exception):
    pass


def _preview(raw: bytes, width: int = 60) -> str:
    text = raw.decode("utf-8", errors="replace")
    text = text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    return text[:width]


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(0, seconds):.0f}s"


def _open_store(directory: str, *, writable: bool = False) -> Store:
    if not os.path.isdir(directory):
        raise UsageError(f"{directory}: not a directory")
    store = Store(directory, space_bytes=1 << 62, readonly=not writable)
    store.scan()
    return store


def _text_head(store: Store, e: Entry, size: int = 256) -> bytes:
    try:
        with store.open(e.ns, e.sha1) as (fd, meta, _):
            return os.pread(fd, min(size, meta.text_len), meta.offsets.text)
    except (OSError, FormatError):
        return b""


def _row(store: Store, e: Entry, now: float) -> dict[str, Any]:
    return {"namespace": e.ns, "sha1": e.sha1, "reason": e.reason.name.lower(),
            "tokens": e.tokens, "bytes": e.size, "hits": e.hits, "age_s": int(now - e.created),
            "last_used_s": int(now - e.last_used), "parent": e.parent,
            "text": _preview(_text_head(store, e))}


def cmd_ls(args: argparse.Namespace) -> int:
    store = _open_store(args.dir)
    now = time.time()
    rows = [_row(store, e, now) for e in sorted(store.index.entries(),
                                                  key=lambda e: (e.ns, -e.last_used))]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'sha1':12} {'reason':9} {'tokens':>8} {'bytes':>12} {'hits':>5} {'age':>6} "
          f"{'parent':12} text")
    for r in rows:
        print(f"{r['sha1'][:12]} {r['reason']:9} {r['tokens']:>8} {r['bytes']:>12} "
              f"{r['hits']:>5} {_age(r['age_s']):>6} {(r['parent'] or '-')[:12]:12} {r['text']}")
    for ns, sha1, why in store.rejected:
        print(f"unreadable {ns}/{sha1}.kv: {why}", file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    path = os.path.abspath(args.file)
    name = os.path.basename(path)
    if not KV_NAME.match(name):
        raise UsageError(f"{args.file}: not a <sha1>.kv file name")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise UsageError(f"{args.file}: {exc.strerror}") from None
    try:
        meta = read_meta(fd, os.fstat(fd).st_size)
        text_head = os.pread(fd, min(meta.text_len, 512), meta.offsets.text)
        tool_map = read_tool_map(fd, meta)
    except FormatError as exc:
        raise UsageError(f"{args.file}: not a valid checkpoint: {exc}") from None
    finally:
        os.close(fd)
    h, p = meta.header, meta.payload
    store = Store(os.path.dirname(os.path.dirname(path)), space_bytes=1 << 62, readonly=True)
    ns = os.path.basename(os.path.dirname(path))
    store.refresh(ns, force=True)
    chain = store.index.chain(ns, name[:40])
    info = {
        "file": path, "format_version": h.version, "kv_dtype": DTYPE_NAMES[h.kv_dtype],
        "reason": h.reason.name.lower(), "flags": h.flags,
        "tool_map": bool(h.flags & FLAG_TOOL_MAP), "delta": bool(h.flags & FLAG_DELTA),
        "tokens": h.tokens, "hits": h.hits, "context_size": h.context_size,
        "created": h.created, "last_used": h.last_used, "payload_bytes": h.payload_bytes,
        "text_bytes": meta.text_len, "fingerprint": p.fingerprint.hex(),
        "parent": p.parent_sha1, "parent_tokens": p.parent_tokens,
        "first_block": p.first_block, "blocks": p.num_blocks,
        "layout": {"name": p.layout.name, "block_size": p.layout.block_size,
                   "layers": p.layout.num_layers, "page_shape": list(p.layout.page_shape),
                   "page_dtype": p.layout.dtype, "page_bytes": p.layout.page_bytes,
                   "tp_rank": p.layout.tp_rank, "tp_size": p.layout.tp_size},
        "token_digest": f"{p.token_digest:016x}",
        "chain": [{"sha1": e.sha1, "tokens": e.tokens} for e in chain] if chain else None,
        "tool_ids": [tid for tid, _ in tool_map],
        "text": _preview(text_head, 200),
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for key, value in info.items():
        if key == "chain":
            value = " -> ".join(f"{c['sha1'][:12]}({c['tokens']})" for c in value) if value \
                else "BROKEN (a parent is missing)"
        print(f"{key:15} {value}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = _open_store(args.dir, writable=args.fix)
    report = verify(store)
    if args.json:
        print(json.dumps({"checked": report.checked, "bytes_checked": report.bytes_checked,
                          "fixed": report.fixed, "ok": report.ok,
                          "problems": [asdict(p) for p in report.problems]}, indent=1))
    else:
        for p in report.problems:
            print(f"{p.kind:8} {p.ns}/{p.sha1}: {p.detail}")
        print(f"checked {report.checked} files ({report.bytes_checked} bytes): "
              f"{len(report.problems)} problem(s)" + (f", {report.fixed} fixed" if args.fix else ""))
    return 0 if report.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    store = _open_store(args.dir, writable=True)
    before = store.index.total_bytes
    removed = store.gc_to(args.to_mb * 1024 * 1024)
    result = {"removed": len(removed), "bytes_before": before,
              "bytes_after": store.index.total_bytes}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"removed {len(removed)} file(s): {before} -> {store.index.total_bytes} bytes")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    store = _open_store(args.dir)
    entries = list(store.index.entries())
    by_reason: dict[str, int] = {}
    for e in entries:
        by_reason[e.reason.name.lower()] = by_reason.get(e.reason.name.lower(), 0) + 1
    result = {"files": len(entries), "bytes": store.index.total_bytes,
              "namespaces": len(store.namespaces()), "tokens_stored": sum(
                  e.tokens - e.parent_tokens for e in entries),
              "hits": sum(e.hits for e in entries), "by_reason": by_reason,
              "quarantined": len(store.quarantined_files()), "unreadable": len(store.rejected)}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            print(f"{key:14} {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvdisk", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, help_ in (("ls", cmd_ls, "list checkpoints"),
                              ("verify", cmd_verify, "check every file and chain"),
                              ("gc", cmd_gc, "evict down to a size"),
                              ("stats", cmd_stats, "totals")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("dir")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
        if name == "verify":
            p.add_argument("--fix", action="store_true",
                           help="quarantine bad files, delete orphans and stale temp files")
        if name == "gc":
            p.add_argument("--to-mb", type=int, required=True)
    p = sub.add_parser("inspect", help="show one file")
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "to_mb", 0) is not None and getattr(args, "to_mb", 0) < 0:
            raise UsageError("--to-mb must be >= 0")
        return args.func(args)
    except UsageError as exc:
        print(f"kvdisk: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
