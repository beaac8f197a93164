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

from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage.scan import Scanner

log = get_logger(__name__)


def start_up(scanner: Scanner, lock_timeout_s: float, *, background: bool = True) -> bool:
    """Index the cache; True if it started from the journal (then the listing runs in a
    thread of its own unless ``background`` is False)."""
    began = time.monotonic()
    root = scanner.directory.root
    if scanner.start():
        log.info("kvdisk: %d files indexed from %s/.journal in %.2f s", len(scanner.index),
                 root, time.monotonic() - began)
        if background:
            threading.Thread(target=scanner.reconcile, name="kvdisk-reconcile",
                             daemon=True).start()
        else:
            scanner.reconcile()
        return True
    scanner.scan()
    scanner.write_snapshot(min(1.0, lock_timeout_s))
    log.info("kvdisk: %d files indexed by a scan of %s in %.2f s", len(scanner.index), root,
             time.monotonic() - began)
    return False
