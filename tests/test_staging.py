import numpy as np

from vllm_kvdisk.connector.staging import StagingPool


def test_buffers_are_reused_by_size_class_and_capped():
    pool = StagingPool(max_bytes=1 << 20)
    a = pool.get(5000)
    assert a.nbytes == 5000 and a.dtype == np.uint8
    base = a.base
    pool.put(a)
    b = pool.get(6000)  # same 8 KiB class: the same memory comes back
    assert b.base is base and b.nbytes == 6000
    big = pool.get(3 << 20)
    pool.put(big)  # over the cap: dropped, not kept
    assert pool.kept_bytes == 0
    pool.put(np.zeros(10, dtype=np.float32))  # foreign arrays are ignored
    assert pool.kept_bytes == 0


def test_custom_allocator_buffers_are_pooled_too():
    import torch

    made = []

    def torch_buffer(nbytes):  # the GPU path's shape: a numpy view of a torch tensor
        made.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8).numpy()

    pool = StagingPool(max_bytes=1 << 20, allocate=torch_buffer)
    a = pool.get(3000)
    assert made == [4096] and a.nbytes == 3000 and not a.any()
    pool.put(a)
    b = pool.get(4000)
    assert made == [4096] and b.base is a.base  # reused, not allocated again
