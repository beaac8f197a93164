"""``kvdisk``: look into and maintain a cache directory without vLLM or torch.

    kvdisk ls DIR                        checkpoints per namespace (model, revision, scope)
    kvdisk inspect FILE                  every header field, layout, chain, tool ids, text
    kvdisk verify DIR [--fix] [--jobs N] checksums, names, orphans, temp files
    kvdisk gc DIR --to-mb N [--dry-run]  evict leaves down to N MiB
    kvdisk rm DIR (--namespace NS | --model NAME) [--dry-run]
    kvdisk stats DIR                     totals, per namespace
    kvdisk why A B                       where prompt B (a file) leaves prompt A
    kvdisk why --trace FILE REQUEST_ID   the lookups of one request, and why

Human sizes and ages by default, ``--json`` for scripts (raw bytes and seconds). Exit 0
when all is well, 1 when ``verify`` found problems, 2 on bad input or an I/O error (a
message on stderr, never a traceback).
Progress goes to stderr when it is a terminal (one counter line, erased when done).

Everything printed passes through ``terminal.say`` (or ``say_json``): checkpoint text,
tool ids, what ``namespace.json`` says and error details come from clients, or from files
anyone with access to the directory may have planted, so their control characters are
printed as escapes and never reach the operator's terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.format import DTYPE_NAMES, FLAG_DELTA, FLAG_TOOL_MAP, FormatError
from vllm_kvdisk.ops.terminal import printable, say, say_json
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage.directory import KV_NAME
from vllm_kvdisk.storage.fileread import read_meta, read_text, read_tool_map
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify


class UsageError(Exception):
    pass


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(0, seconds):.0f}s"


def human_time(epoch: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch)) if epoch else "-"


def _preview(raw: bytes, width: int = 60) -> str:
    return printable(raw.decode("utf-8", errors="replace"))[:width]


def _progress(label: str) -> Callable[[int, int], None] | None:
    """A counter line on a terminal's stderr, else nothing. Plain text on purpose: the
    CLI runs where only the core's dependencies are installed, and a bar is cosmetic."""
    if not sys.stderr.isatty():
        return None

    def update(done: int, total: int) -> None:
        # "\r" rewrites the line in place; "\x1b[K" erases it when done (nothing is left).
        line = "\r\x1b[K" if done >= total else f"\r{label}: {done}/{total} files"
        sys.stderr.write(line)
        sys.stderr.flush()

    return update


def _open_store(directory: str, *, writable: bool = False, scan: bool = True) -> Store:
    if not os.path.isdir(directory):
        raise UsageError(f"{directory}: not a directory")
    try:
        store = Store(directory, space_bytes=1 << 62, readonly=not writable, allow_shared_dir=True)
    except OSError as exc:
        raise UsageError(f"{directory}: {exc}") from None
    if scan:
        store.scan()
    return store


def namespace_label(store: Store, ns: str) -> dict[str, Any]:
    info = store.namespace_info(ns) or {}
    return {
        "namespace": ns,
        "model": info.get("model"),
        "revision": info.get("revision"),
        "kv_dtype": info.get("kv_dtype"),
        "block_size": info.get("block_size"),
        "tp": f"{info.get('tp_rank', '?')}/{info.get('tp_size', '?')}",
        "lora": info.get("lora") or None,
        "salted": bool(info.get("salt_digest")),
        "format_version": info.get("format_version"),
    }


def _describe(label: dict[str, Any]) -> str:
    extra = [f"lora={label['lora']}"] if label["lora"] else []
    extra += ["salted"] if label["salted"] else []
    return (
        f"namespace {label['namespace']}: {label['model']} @ {label['revision'] or '-'}, "
        f"{label['kv_dtype']}, block {label['block_size']}, TP rank {label['tp']}"
        + (f" ({', '.join(extra)})" if extra else "")
    )


def _opening(store: Store, e: Entry, size: int = 256) -> tuple[bytes, int, int]:
    """The text's first ``size`` bytes and the pages' bytes decoded and stored (they
    differ when the pages are compressed: payload version 4); zeros if unreadable."""
    try:
        with store.open(e.ns, e.sha1) as (fd, meta, _):
            text = read_text(fd, meta, size) if size else b""
            return text, meta.offsets.raw_bytes, meta.offsets.stored_bytes
    except (OSError, FormatError):
        return b"", 0, 0


def _row(store: Store, e: Entry, now: float) -> dict[str, Any]:
    text, raw, stored = _opening(store, e)
    return {
        "namespace": e.ns,
        "sha1": e.sha1,
        "reason": e.reason.name.lower(),
        "tokens": e.tokens,
        "parent_tokens": e.parent_tokens,
        "bytes": e.size,
        "raw_page_bytes": raw,
        "stored_page_bytes": stored,
        "hits": e.hits,
        "age_s": int(now - e.created),
        "last_used_s": int(now - e.last_used),
        "parent": e.parent,
        "text": _preview(text),
    }


def _ratio(raw: int, stored: int) -> str:
    """Decoded over stored page bytes: ``1.00`` for raw pages, ``-`` if unreadable."""
    return f"{raw / stored:.2f}" if stored else "-"


def cmd_ls(args: argparse.Namespace) -> int:
    store = _open_store(args.dir)
    now = time.time()
    by_ns: dict[str, list[Entry]] = {}
    for e in store.index.entries():
        by_ns.setdefault(e.ns, []).append(e)
    if args.json:
        rows = [
            {**_row(store, e, now), "model": namespace_label(store, e.ns)["model"]}
            for ns in sorted(by_ns)
            for e in sorted(by_ns[ns], key=lambda e: -e.last_used)
        ]
        say_json(rows, indent=1)
        return 0
    for ns in sorted(by_ns):
        say(_describe(namespace_label(store, ns)))
        say(
            f"  {'sha1':12} {'reason':9} {'tokens':>13} {'size':>10} {'ratio':>5} "
            f"{'hits':>5} {'age':>6} {'used':>6} {'parent':12} text"
        )
        for e in sorted(by_ns[ns], key=lambda e: -e.last_used):
            r = _row(store, e, now)
            span = f"{r['parent_tokens']}..{r['tokens']}"
            say(
                f"  {r['sha1'][:12]} {r['reason']:9} {span:>13} {human_bytes(r['bytes']):>10} "
                f"{_ratio(r['raw_page_bytes'], r['stored_page_bytes']):>5} {r['hits']:>5} "
                f"{human_age(r['age_s']):>6} {human_age(r['last_used_s']):>6} "
                f"{(r['parent'] or '-')[:12]:12} {r['text']}"
            )
    for ns, sha1, why in store.rejected:
        say(f"unreadable {ns}/{sha1}.kv: {why}", file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    path = os.path.abspath(args.file)
    name = os.path.basename(path)
    if not KV_NAME.match(name):
        raise UsageError(f"{args.file}: not a <sha1>.kv file name")
    try:  # a FIFO or a device named like a checkpoint is refused, never opened blocking
        fd = fsdir.open_regular(path)
    except OSError as exc:
        raise UsageError(f"{args.file}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        meta = read_meta(fd, size)
        text_head = read_text(fd, meta, 512)
        tool_map = read_tool_map(fd, meta)
    except FormatError as exc:
        raise UsageError(f"{args.file}: not a valid checkpoint: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{args.file}: {exc.strerror or exc}") from None
    finally:
        fsdir.close_read(fd)
    h, p = meta.header, meta.payload
    store = Store(os.path.dirname(os.path.dirname(path)), space_bytes=1 << 62, readonly=True)
    ns = os.path.basename(os.path.dirname(path))
    store.refresh(ns, force=True)
    chain = store.index.chain(ns, name[:40])
    info = {
        "file": path,
        "format_version": h.version,
        "kv_dtype": DTYPE_NAMES[h.kv_dtype],
        "reason": h.reason.name.lower(),
        "flags": h.flags,
        "tool_map": bool(h.flags & FLAG_TOOL_MAP),
        "delta": bool(h.flags & FLAG_DELTA),
        "tokens": h.tokens,
        "hits": h.hits,
        "context_size": h.context_size,
        "created": h.created,
        "last_used": h.last_used,
        "payload_bytes": h.payload_bytes,
        "text_bytes": meta.text_len,
        "fingerprint": p.fingerprint.hex(),
        "payload_version": p.version,
        "parent": p.parent_sha1,
        "parent_tokens": p.parent_tokens,
        "first_block": p.first_block,
        "blocks": p.num_blocks,
        "layout": {
            "name": p.layout.name,
            "block_size": p.layout.block_size,
            "layers": p.layout.num_layers,
            "page_shape": list(p.layout.page_shape),
            "page_dtype": p.layout.dtype,
            "page_bytes": p.layout.page_bytes,
            "tp_rank": p.layout.tp_rank,
            "tp_size": p.layout.tp_size,
        },
        "groups": [
            {
                "kind": g.kind.name.lower(),
                "layers": g.layers,
                "window": g.window,
                "first_block": g.first_block,
                "blocks": g.num_blocks,
            }
            for g in p.groups
        ],
        "token_digest": f"{p.token_digest:016x}",
        "pages": {
            "raw_bytes": meta.offsets.raw_bytes,
            "stored_bytes": meta.offsets.stored_bytes,
            "compressed": p.packing is not None,
            "chunks": len(p.packing.chunks) if p.packing is not None else 0,
            "chunk_pages": p.packing.chunk_pages if p.packing is not None else 0,
        },
        "chain": [
            {"sha1": e.sha1, "tokens": e.tokens, "parent_tokens": e.parent_tokens} for e in chain
        ]
        if chain
        else None,
        "namespace": namespace_label(store, ns),
        "tool_ids": [tid for tid, _ in tool_map],
        "text": _preview(text_head, 200),
    }
    if args.json:
        say_json(info, indent=1)
        return 0
    lay = info["layout"]
    now = time.time()
    lines = [
        ("file", path),
        ("model", _describe(info["namespace"])),
        (
            "format",
            f"version {h.version} (payload {p.version}), KV dtype {info['kv_dtype']}, "
            f"reason {info['reason']}",
        ),
        (
            "tokens",
            f"{p.parent_tokens}..{h.tokens} "
            f"(blocks {p.first_block}..{p.first_block + p.num_blocks})",
        ),
        (
            "parent",
            f"{p.parent_sha1} (first {p.parent_tokens} tokens)"
            if p.parent_sha1
            else "none (a root)",
        ),
        ("created", f"{human_time(h.created)} ({human_age(now - h.created)} ago)"),
        (
            "last used",
            f"{human_time(h.last_used)} ({human_age(now - h.last_used)} ago), {h.hits} hit(s)",
        ),
        (
            "size",
            f"{human_bytes(size)}: text {human_bytes(meta.text_len)}, "
            f"payload {human_bytes(h.payload_bytes)}",
        ),
        (
            "pages",
            f"{human_bytes(meta.offsets.raw_bytes)} decoded, "
            f"{human_bytes(meta.offsets.stored_bytes)} on disk "
            + (
                f"(compressed, {len(p.packing.chunks)} chunks of up to {p.packing.chunk_pages} "
                f"pages, ratio {_ratio(meta.offsets.raw_bytes, meta.offsets.stored_bytes)})"
                if p.packing is not None
                else "(raw)"
            ),
        ),
        (
            "layout",
            f"{lay['name']}: {lay['layers']} layers, pages of "
            f"{lay['page_shape']} {lay['page_dtype']} ({human_bytes(lay['page_bytes'])} "
            f"each), block {lay['block_size']}, TP {lay['tp_rank']}/{lay['tp_size']}",
        ),
        (
            "groups",
            "; ".join(
                f"state after {h.tokens} tokens: {g['layers']} layer(s) x block {g['first_block']}"
                if g["kind"] == "state"
                else f"{g['kind']}{' ' + str(g['window']) if g['window'] else ''}: {g['layers']} "
                f"layer(s) x blocks {g['first_block']}..{g['first_block'] + g['blocks']}"
                for g in info["groups"]
            ),
        ),
        (
            "chain",
            " -> ".join(
                f"{c['sha1'][:12]}({c['parent_tokens']}..{c['tokens']})" for c in info["chain"]
            )
            if info["chain"]
            else "BROKEN (a parent is missing)",
        ),
        ("tool ids", ", ".join(info["tool_ids"]) or "-"),
        ("text", info["text"]),
    ]
    for key, value in lines:
        say(f"{key:10} {value}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    # verify scans itself: a writable scan quarantines what does not parse, and only the
    # scan verify runs can report what it moved.
    store = _open_store(args.dir, writable=args.fix, scan=False)
    report = verify(store, jobs=args.jobs, progress=_progress("verify"))
    if args.json:
        say_json(
            {
                "checked": report.checked,
                "bytes_checked": report.bytes_checked,
                "fixed": report.fixed,
                "ok": report.ok,
                "writing": report.writing,
                "problems": [
                    {
                        "ns": p.ns,
                        "sha1": p.sha1,
                        "kind": p.kind,
                        "detail": p.detail,
                        "fixed": p.fixed or None,
                    }
                    for p in report.problems
                ],
            },
            indent=1,
        )
    else:
        for p in report.problems:
            say(f"{p.kind:11} {p.ns}/{p.sha1}: {p.detail}" + (f" ({p.fixed})" if p.fixed else ""))
        say(
            f"checked {report.checked} files ({human_bytes(report.bytes_checked)}): "
            f"{len(report.problems)} problem(s)"
            + (f", {report.fixed} fixed" if args.fix else "")
            + (f"; {report.writing} write(s) in progress" if report.writing else "")
        )
    return 0 if report.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    store = _open_store(args.dir, writable=True)
    before = store.index.total_bytes
    removed = store.gc_to(args.to_mb * 1024 * 1024, dry_run=args.dry_run)
    after = before - sum(e.size for e in removed)
    # namespaces left with nothing in them for a while (every cache salt ever seen)
    emptied = 0 if args.dry_run else store.remove_empty_namespaces()
    if args.json:
        say_json(
            {
                "removed": len(removed),
                "empty_namespaces_removed": emptied,
                "bytes_before": before,
                "bytes_after": after,
                "dry_run": args.dry_run,
                "files": [{"ns": e.ns, "sha1": e.sha1, "bytes": e.size} for e in removed],
            }
        )
    else:
        verb = "would remove" if args.dry_run else "removed"
        for e in removed if args.dry_run else ():
            say(f"{e.ns}/{e.sha1}.kv {human_bytes(e.size)}")
        say(
            f"{verb} {len(removed)} file(s): {human_bytes(before)} -> {human_bytes(after)}"
            + (f"; {emptied} empty namespace(s) removed" if emptied else "")
        )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    store = _open_store(args.dir, writable=True)
    chosen = []
    for ns in store.namespaces():
        label = namespace_label(store, ns)
        if ns == args.namespace or (args.model is not None and label["model"] == args.model):
            chosen.append(label)
    if not chosen:
        raise UsageError(f"no namespace matches {args.namespace or args.model!r} in {args.dir}")
    out = []
    for label in chosen:
        files = [e for e in store.index.namespace_entries(label["namespace"])]
        count = len(files) if args.dry_run else store.remove_namespace(label["namespace"])
        out.append({**label, "files": count, "bytes": sum(e.size for e in files)})
    if args.json:
        say_json({"dry_run": args.dry_run, "namespaces": out}, indent=1)
    else:
        verb = "would remove" if args.dry_run else "removed"
        for row in out:
            say(f"{verb} {row['files']} file(s), {human_bytes(row['bytes'])}: {_describe(row)}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    store = _open_store(args.dir)
    entries = list(store.index.entries())
    by_reason: dict[str, int] = {}
    for e in entries:
        by_reason[e.reason.name.lower()] = by_reason.get(e.reason.name.lower(), 0) + 1
    spaces = []
    for ns in store.namespaces():
        mine = store.index.namespace_entries(ns)
        pages = [_opening(store, e, 0)[1:] for e in mine]
        spaces.append(
            {
                **namespace_label(store, ns),
                "files": len(mine),
                "bytes": sum(e.size for e in mine),
                "raw_page_bytes": sum(raw for raw, _ in pages),
                "stored_page_bytes": sum(stored for _, stored in pages),
                "tokens_stored": sum(e.tokens - e.parent_tokens for e in mine),
            }
        )
    result: dict[str, Any] = {
        "files": len(entries),
        "bytes": store.index.total_bytes,
        "namespaces": spaces,
        "raw_page_bytes": sum(row["raw_page_bytes"] for row in spaces),
        "stored_page_bytes": sum(row["stored_page_bytes"] for row in spaces),
        "tokens_stored": sum(e.tokens - e.parent_tokens for e in entries),
        "hits": sum(e.hits for e in entries),
        "by_reason": by_reason,
        "quarantined": len(store.quarantined_files()),
        "unreadable": len(store.rejected),
    }
    if args.json:
        say_json(result, indent=1)
        return 0
    say(
        f"{result['files']} checkpoint(s), {human_bytes(result['bytes'])}, "
        f"{result['tokens_stored']} tokens stored, {result['hits']} hit(s)"
    )
    say(
        f"pages: {human_bytes(result['raw_page_bytes'])} decoded, "
        f"{human_bytes(result['stored_page_bytes'])} on disk (ratio "
        f"{_ratio(result['raw_page_bytes'], result['stored_page_bytes'])})"
    )
    say("by reason: " + (", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())) or "-"))
    say(f"quarantined: {result['quarantined']}, unreadable: {result['unreadable']}")
    for row in spaces:
        say(
            f"{_describe(row)}\n  {row['files']} file(s), {human_bytes(row['bytes'])}, "
            f"{row['tokens_stored']} tokens, pages ratio "
            f"{_ratio(row['raw_page_bytes'], row['stored_page_bytes'])}"
        )
    return 0


def cmd_why(args: argparse.Namespace) -> int:
    from vllm_kvdisk.ops import why

    if args.trace:
        if args.b is not None:
            raise UsageError("with --trace, give one request id")
        events = why.traced(args.trace, args.a)
        if args.json:
            say_json(
                [
                    {"kind": e.kind, "sha1": e.sha1, "request": e.request, "detail": e.detail}
                    for e in events
                ]
            )
        for e in events if not args.json else ():
            say(e.line)
        if not events:
            say(
                f"kvdisk: no lookup of request {printable(args.a)} in {args.trace}", file=sys.stderr
            )
            return 1
        return 0
    if args.b is None:
        raise UsageError("give two prompt files, or --trace FILE and a request id")
    found = why.compare(why.load_prompt(args.a), why.load_prompt(args.b), args.width)
    if args.json:
        say_json(found.to_dict() if found is not None else None)
        return 0
    if found is None:
        say("the same prompt: nothing differs")
        return 0
    say(found.words)
    if found.excerpts != ("", ""):
        say(f"  A: {printable(found.excerpts[0])}")
        say(f"  B: {printable(found.excerpts[1])}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("vllm-kvdisk")
    except PackageNotFoundError:
        ours = "unknown"
    parser = argparse.ArgumentParser(prog="kvdisk", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"kvdisk {ours}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, help_ in (
        ("ls", cmd_ls, "list checkpoints"),
        ("verify", cmd_verify, "check every file and chain"),
        ("gc", cmd_gc, "evict down to a size"),
        ("rm", cmd_rm, "remove one namespace or model"),
        ("stats", cmd_stats, "totals"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("dir")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
        if name == "verify":
            p.add_argument(
                "--fix",
                action="store_true",
                help="quarantine bad files, delete orphans and abandoned temp files",
            )
            p.add_argument("--jobs", type=int, default=1, help="files checked at once")
        if name == "gc":
            p.add_argument("--to-mb", type=int, required=True)
        if name in ("gc", "rm"):
            p.add_argument("--dry-run", action="store_true", help="only say what would go")
        if name == "rm":
            which = p.add_mutually_exclusive_group(required=True)
            which.add_argument("--namespace", help="a namespace directory name (16 hex digits)")
            which.add_argument("--model", help="every namespace of this model (as in `ls`)")
    p = sub.add_parser("inspect", help="show one file")
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("why", help="where one prompt leaves another, or one request's lookups")
    p.add_argument(
        "a", help="prompt file A (chat JSON, completions JSON or text); with --trace, a request id"
    )
    p.add_argument("b", nargs="?", help="prompt file B")
    p.add_argument("--trace", help="the trace file (--trace of the server)")
    p.add_argument("--width", type=int, default=80, help="characters of each excerpt")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_why)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "to_mb", 0) is not None and getattr(args, "to_mb", 0) < 0:
            raise UsageError("--to-mb must be >= 0")
        if getattr(args, "jobs", 1) < 1:
            raise UsageError("--jobs must be >= 1")
        if getattr(args, "width", 0) < 0:
            raise UsageError("--width must be >= 0")
        return args.func(args)
    except UsageError as exc:
        say(f"kvdisk: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except (OSError, FormatError) as exc:  # the directory changed or failed under us
        say(f"kvdisk: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        say("kvdisk: out of memory", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
