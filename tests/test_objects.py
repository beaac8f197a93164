"""The object tier's pure part: object keys, a prompt's candidate names, what to fetch,
when to list again."""

import hashlib

import pytest
from synth import BLOCK, byte_table, prompt

from vllm_kvdisk.core.objects import (
    LIST_EVERY_S,
    LIST_ON_MISS_EVERY_S,
    Listing,
    ObjectUrl,
    prefix_names,
    to_fetch,
)

SHA = "0123456789abcdef0123456789abcdef01234567"


def test_url_keys_and_foreign_objects():
    url = ObjectUrl.parse("s3://my-bucket/fleet/a/")
    assert (url.bucket, url.prefix) == ("my-bucket", "fleet/a")
    assert url.key("00ff", SHA) == f"fleet/a/00ff/{SHA}.kv"
    assert url.name_of("00ff", url.key("00ff", SHA)) == SHA
    for other in (
        f"fleet/a/00ff/{SHA}.kv.tmp",
        "fleet/a/00ff/namespace.json",
        f"fleet/a/00fe/{SHA}.kv",
        f"fleet/a/00ff/x/{SHA}.kv",
        "README",
    ):
        assert url.name_of("00ff", other) is None
    assert ObjectUrl.parse("s3://my-bucket").key("n", SHA) == f"n/{SHA}.kv"
    for bad in ("my-bucket/x", "s3://B/x", "s3://ab/x", "s3://my-bucket/a/../b", "gs://b/x"):
        with pytest.raises(ValueError):
            ObjectUrl.parse(bad)


def test_prefix_names_are_the_files_names():
    p = prompt(3, 200)
    names = prefix_names(byte_table(), p.ids, BLOCK, 170, first=32)
    assert [n for n, _ in names] == list(range(32, 161, BLOCK))
    for n, sha1 in names:
        assert sha1 == p.sha1_at(n) == hashlib.sha1(p.text_upto(n)).hexdigest()


def test_to_fetch_only_when_the_bucket_goes_deeper():
    names = [(16, "a"), (32, "b"), (48, "c"), (64, "d")]
    local = {"a"}.__contains__
    assert to_fetch(names, {"a", "c"}, local, 16) == [(48, "c")]
    assert to_fetch(names, {"a", "b", "c"}, local, 16) == [(32, "b"), (48, "c")]
    assert to_fetch(names, {"a", "c"}, local, 48) == []  # the local hit is as deep
    assert to_fetch(names, set(), local, 0) == []


def test_listing_is_rate_bounded():
    listing = Listing(set())
    assert listing.due(0.0, missed=False)
    listing.listed_at = 100.0
    assert not listing.due(100.0 + LIST_ON_MISS_EVERY_S - 1, missed=True)
    assert listing.due(100.0 + LIST_ON_MISS_EVERY_S, missed=True)
    assert not listing.due(100.0 + LIST_EVERY_S - 1, missed=False)
    assert listing.due(100.0 + LIST_EVERY_S, missed=False)
    listing.listing = True
    assert not listing.due(1e9, missed=True)
