"""A process the object tier's kill -9 tests start and kill while its transfer is in
flight: it uploads one checkpoint of a directory, or fetches names into a directory,
through the object tier (the AWS variables of its environment name the store).

    python tests/object_child.py upload ROOT s3://BUCKET/PREFIX NS SHA1
    python tests/object_child.py fetch ROOT s3://BUCKET/PREFIX NS '[[tokens, sha1], ...]'

It prints ``done`` if the transfer ended (the tests kill it before).
"""

from __future__ import annotations

import json
import sys

from vllm_kvdisk.core.objects import ObjectUrl
from vllm_kvdisk.storage.objectstore import Bucket
from vllm_kvdisk.storage.objecttier import ObjectTier
from vllm_kvdisk.storage.store import Store


def main() -> None:
    what, root, url, ns, arg = sys.argv[1:6]
    store = Store(root, space_bytes=1 << 30)
    tier = ObjectTier(store, Bucket(ObjectUrl.parse(url), timeout_s=300.0), deadline_s=300.0)
    if what == "upload":
        tier.saved(ns, arg)
        tier.drain(300.0)
    else:
        names = [(int(n), str(s)) for n, s in json.loads(arg)]
        job = tier.fetch(ns, lambda: names, 0, lambda s: store.index.get(ns, s) is not None)
        if job is not None:
            job.done.wait(300.0)
    print("done", flush=True)


if __name__ == "__main__":
    main()
