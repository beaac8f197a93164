"""Bringing a store's index up at start-up: from the journal when it can be used, else
by a scan whose index then becomes the journal's snapshot.

A start from the journal reads one file (100k checkpoints: about a second, on the local
disk or GlusterFS) instead of every file's first bytes (80 s on GlusterFS), then lists
the directory once, in the background, for what the journal missed (files of a writer
killed before its line, files deleted by hand). Lookups run meanwhile on what the
journal said: a file it names that is gone is a miss when its load fails.

Pure of vLLM and torch.
"""

from __future__ import annotations

import threading
import time
import weakref

from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage.scan import Scanner

log = get_logger(__name__)


RECONCILE_EVERY_S = 600.0  # a running store lists the directory again this often


def start_up(scanner: Scanner, lock_timeout_s: float, *, background: bool = True) -> bool:
    """Index the cache; True if it started from the journal. ``background``: a thread
    lists the directory (at once after a start from the journal, then every
    ``RECONCILE_EVERY_S``), so a long-running store also picks up what no journal line
    says (a writer killed between its rename and its line, ``rm`` by hand) and removes
    temp files of dead writers; without it, the listing after a journal start runs here."""
    began = time.monotonic()
    root = scanner.directory.root
    journaled = scanner.start()
    if journaled:
        log.info(
            "kvdisk: %d files indexed from %s/.journal in %.2f s",
            len(scanner.index),
            root,
            time.monotonic() - began,
        )
        if not background:
            scanner.reconcile()
    else:
        scanner.scan()
        scanner.write_snapshot(min(1.0, lock_timeout_s))
        log.info(
            "kvdisk: %d files indexed by a scan of %s in %.2f s",
            len(scanner.index),
            root,
            time.monotonic() - began,
        )
    if background and not scanner.directory.readonly:
        # A weak reference: the thread must not keep a dropped store alive (nor, through
        # its callbacks, an engine's KV cache: in-process engines of a test run ran out
        # of memory that way).
        threading.Thread(
            target=_reconcile_forever,
            args=(weakref.ref(scanner), journaled),
            name="kvdisk-reconcile",
            daemon=True,
        ).start()
    return journaled


def _reconcile_forever(ref: weakref.ref[Scanner], now: bool) -> None:
    # The first listing after a start from the journal stats every file (the journal's
    # inodes may be another volume's: a copied cache); later ones compare inodes, the
    # journal and the catch-ups' listings keep the rest (a stat per file is ~0.8 ms on
    # GlusterFS: 80 s per 100k files every 10 minutes).
    identity = now
    while True:
        scanner = ref()
        if scanner is None or scanner.directory.fd < 0:
            return  # the store was dropped or closed
        if now:
            try:
                scanner.reconcile(identity=identity)
                identity = False
            except Exception:  # noqa: BLE001 - a bug of ours must not end the listings
                log.exception("kvdisk: listing %s failed", scanner.directory.root)
        del scanner
        now = True
        time.sleep(RECONCILE_EVERY_S)
