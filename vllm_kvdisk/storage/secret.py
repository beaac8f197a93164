"""``ROOT/.salt-key``: the cache directory's secret, which keys every cache salt's digest.

A namespace's name and ``namespace.json`` derive from its cache salt's digest. Unkeyed
(a plain SHA-256 of the salt), anyone who can read the directory confirms a guessed salt
offline; keyed with a secret only the directory holds (HMAC-SHA256, ``keys.salt_digest``),
the digest says nothing about the salt to whoever lacks the key.

* 32 random bytes, 0600, created once per root: written to a temp file, fsynced, then
  linked to its name, which fails if another process linked first (no rename over it);
  the loser reads the winner's. Every replica of the root reads the same key, so their
  namespaces stay shared.
* A key that is there but not 32 bytes, or not a regular file, is an error to report,
  not one to replace: another key would silently strand every salted namespace.

Pure of vLLM and torch.
"""

from __future__ import annotations

import contextlib
import os
import secrets

from vllm_kvdisk.storage import fsdir

NAME = ".salt-key"
KEY_BYTES = 32


class BadSaltKey(ValueError):
    pass


def _read(dir_fd: int) -> bytes | None:
    try:
        fd = fsdir.open_regular(NAME, dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadSaltKey(f"{NAME} cannot be read: {exc}") from None
    try:
        raw = os.pread(fd, KEY_BYTES + 1, 0)
    finally:
        fsdir.close_read(fd)
    if len(raw) != KEY_BYTES:
        raise BadSaltKey(
            f"{NAME} holds {len(raw)} bytes, not {KEY_BYTES}: restore it, or delete it "
            "(every salted namespace then becomes unreachable)"
        )
    return raw


def salt_key(dir_fd: int, *, create: bool) -> bytes | None:
    """The root's key; made if there is none and ``create`` (else None)."""
    found = _read(dir_fd)
    if found is not None or not create:
        return found
    with fsdir.TempFile(dir_fd, NAME) as tmp:
        tmp.write([secrets.token_bytes(KEY_BYTES)])
        with contextlib.suppress(FileExistsError):  # another replica linked its key first
            os.link(tmp.name, NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
    found = _read(dir_fd)
    if found is None:
        raise BadSaltKey(f"{NAME} vanished while it was made")
    return found
