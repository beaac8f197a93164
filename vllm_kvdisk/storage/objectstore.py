"""An S3 bucket as the object tier sees it: list a namespace's names, put a file once,
get an object into a file with parallel ranged GETs, delete a corrupt one.

The client is boto3 (the ``object`` extra), imported when a bucket is first used so the
rest of the package imports without it. Endpoint, region and credentials come from the
usual AWS variables and files (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), never
from kvdisk's own configuration and never logged; TLS is boto3's default (``https``)
unless the endpoint says ``http://``. Every call has connect and read timeouts and few
retries, so a store that is down or slow fails a call within a bounded time. Writes
are conditional (``If-None-Match: *``): an object is never replaced, and a store that
does not know the condition writes the same bytes again, which is harmless (a name is
its content).

Pure of vLLM and torch.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_kvdisk.core.objects import ObjectUrl

PART_BYTES = 8 * 2**20  # one ranged GET
GET_THREADS = 8


class ObjectStoreError(Exception):
    """A call to the object store failed (down, slow, refused); the message says how."""


class Bucket:
    def __init__(
        self, url: ObjectUrl, *, timeout_s: float, client: Any = None, threads: int = GET_THREADS
    ):
        self.url = url
        self.timeout_s = timeout_s
        self._client = client
        self._client_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvdisk-get")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                import boto3  # type: ignore[import-untyped]
                from botocore.config import Config  # type: ignore[import-untyped]

                self._client = boto3.session.Session().client(
                    "s3",
                    config=Config(
                        connect_timeout=self.timeout_s,
                        read_timeout=self.timeout_s,
                        retries={"max_attempts": 2, "mode": "standard"},
                        max_pool_connections=GET_THREADS * 2,
                    ),
                )
            return self._client

    def _call(self, what: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 - botocore's many kinds: all a failed call
            raise ObjectStoreError(f"{what}: {_why(exc)}") from None

    def list_names(self, ns: str) -> set[str]:
        """Every checkpoint name of ``ns`` in the bucket (other keys are ignored)."""
        head = self.url.ns_prefix(ns)
        names: set[str] = set()
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Prefix": head}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("list", self.client.list_objects_v2, **kwargs)
            for item in page.get("Contents", ()):
                name = self.url.name_of(ns, str(item.get("Key", "")))
                if name is not None:
                    names.add(name)
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return names

    def put_file(self, ns: str, sha1: str, fd: int, size: int) -> bool:
        """Upload ``size`` bytes of ``fd`` as ``ns/sha1``; False if the object was there
        already (the store refused the conditional write)."""
        with os.fdopen(os.dup(fd), "rb") as body:
            try:
                self.client.put_object(
                    Bucket=self.url.bucket,
                    Key=self.url.key(ns, sha1),
                    Body=body,
                    ContentLength=size,
                    IfNoneMatch="*",
                )
            except Exception as exc:  # noqa: BLE001
                if _status(exc) in (409, 412):
                    return False
                raise ObjectStoreError(f"put: {_why(exc)}") from None
        return True

    def get_into(self, ns: str, sha1: str, target: Callable[[int], int | None]) -> int | None:
        """Download the object into the descriptor ``target(size)`` gives, at offset 0;
        its size, or None if there is no such object or ``target`` gave None. The first
        ranged GET (``PART_BYTES``) tells the size, no HEAD before it; the other ranges
        run in parallel while this thread writes the first one's bytes."""
        key = self.url.key(ns, sha1)
        try:
            first = self.client.get_object(
                Bucket=self.url.bucket, Key=key, Range=f"bytes=0-{PART_BYTES - 1}"
            )
        except Exception as exc:  # noqa: BLE001
            if _status(exc) in (404, 416):  # none, or empty (not a checkpoint either)
                return None
            raise ObjectStoreError(f"get: {_why(exc)}") from None
        body = first["Body"]
        try:
            size = _total_size(first)
            if size is None:
                raise ObjectStoreError(f"get: {key}: no size in the answer")
            fd = target(size)
            if fd is None:
                return None
            futures = [
                self._pool.submit(self._get_part, key, fd, start, min(size, start + PART_BYTES))
                for start in range(PART_BYTES, size, PART_BYTES)
            ]
            try:
                _copy(body, fd, key, 0, min(size, PART_BYTES))
            finally:
                for future in futures:  # every part ended before the fd may be closed
                    future.result()
            return size
        finally:
            body.close()

    def _get_part(self, key: str, fd: int, start: int, stop: int) -> None:
        got = self._call(
            "get",
            self.client.get_object,
            Bucket=self.url.bucket,
            Key=key,
            Range=f"bytes={start}-{stop - 1}",
        )
        try:
            _copy(got["Body"], fd, key, start, stop)
        finally:
            got["Body"].close()

    def delete(self, ns: str, sha1: str) -> None:
        self._call(
            "delete", self.client.delete_object, Bucket=self.url.bucket, Key=self.url.key(ns, sha1)
        )


def _total_size(got: dict[str, Any]) -> int | None:
    """The whole object's size from a ranged GET's answer (``Content-Range: bytes
    0-N/TOTAL``; a store that ignored the range sent all of it)."""
    content_range = str(got.get("ContentRange") or "")
    if not content_range:
        length = got.get("ContentLength")
        return int(length) if isinstance(length, int) else None
    total = content_range.rpartition("/")[2]
    return int(total) if total.isdigit() else None


def _copy(body: Any, fd: int, key: str, start: int, stop: int) -> None:
    """Bytes ``[start, stop)`` of an object, streamed from ``body`` into ``fd``."""
    at = start
    while at < stop:
        try:
            chunk = body.read(min(2**20, stop - at))
        except Exception as exc:  # noqa: BLE001 - a read timeout, a reset: a failed call
            raise ObjectStoreError(f"get: {_why(exc)}") from None
        if not chunk:
            raise ObjectStoreError(f"get: {key} ended at byte {at} of {stop}")
        written = os.pwrite(fd, chunk, at)
        if written != len(chunk):
            raise OSError(f"short write of {key} at {at}")
        at += written


def _status(exc: Exception) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if isinstance(status, int) else None
    return None


def _why(exc: Exception) -> str:
    """A failure in words, without request headers (credentials are signed into them)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error", {})
        return f"{error.get('Code', '?')} (HTTP {_status(exc)})"
    return type(exc).__name__ + (f": {exc}" if "Credential" not in str(exc) else "")
