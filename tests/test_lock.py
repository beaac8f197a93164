"""ROOT/.lock: waited on with a timeout; a stuck holder costs a skipped save."""

import os

import numpy as np
import pytest
from synth import make, prompt, save

from vllm_kvdisk.storage.budget import SaveSkipped


def test_the_lock_is_waited_on_with_a_timeout(tmp_path):
    import fcntl

    store, ns = make(tmp_path, lock_timeout_s=0.3)
    rng = np.random.default_rng(0)
    holder = os.open(os.path.join(store.root, ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a stuck process (an NFS unlink that never returns)
    try:
        with pytest.raises(SaveSkipped, match="lock_timeout"):
            save(store, ns, prompt(80), 48, rng)
    finally:
        os.close(holder)
    save(store, ns, prompt(80), 48, rng)  # free again
