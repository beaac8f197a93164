"""Move whole KV pages between the engine's cache tensors and host buffers.

Each layer's cache is seen as ``[num_blocks, page_bytes]`` bytes (its logical per-block
contents, whatever the backend packs inside a page), so a page is copied as an opaque unit
and never reinterpreted. A backend that splits blocks into smaller kernel blocks hands
views at kernel-block granularity; they are grouped back so a page is always one of the
scheduler's blocks (``group_kernel_blocks``). On a device, gathering is ``index_select`` and
scattering ``index_copy_``, per layer, in pieces of at most ``DEVICE_TRANSIENT_BYTES`` of
pages: the piece in flight is the only device memory a copy takes, outside vLLM's memory
profile (one layer of a 30k-token Llama-3.1-8B save at once would be 120 MB). The CPU
backend's host-resident layers are copied with plain numpy row copies. The caller provides
reusable host buffers (see ``staging.py``). On a GPU copies run on a side stream behind
the compute stream; ``gather`` and ``scatter`` return only after the copy is complete
(they run on the worker's copy and I/O threads, never on the engine thread).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import cast

import numpy as np
import torch

from vllm_kvdisk.core.format import PageLayout

# The most device memory one page copy's temporary takes (a piece of one layer's pages).
DEVICE_TRANSIENT_BYTES = 16 << 20

TORCH_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.uint8: "uint8",
    getattr(torch, "float8_e4m3fn", None): "fp8_e4m3",
    getattr(torch, "float8_e5m2", None): "fp8_e5m2",
}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"kvdisk: KV cache dtype {dtype} is not supported") from None


def unique_layers(kv_caches: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Layers in model order, each backing tensor once (shared-KV layers alias one)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = []
    for name, tensor in kv_caches.items():
        ident = (tensor.data_ptr(), tuple(tensor.shape))
        if ident not in seen:
            seen.add(ident)
            out.append((name, tensor))
    return out


def pinned_buffer(nbytes: int) -> np.ndarray:
    """Page-locked host memory as a uint8 numpy array (it keeps its tensor alive), so
    copies to and from a GPU are DMA transfers; plain memory if pinning is refused."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    except RuntimeError:
        return np.empty(nbytes, dtype=np.uint8)


def group_kernel_blocks(layers: Sequence[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Per-layer views with the scheduler's blocks as dim 0.

    A backend whose kernel block is smaller than vLLM's block (FlashInfer, FlashMLA) hands
    views of ``num_blocks x ratio`` kernel blocks; block ``b`` is kernel blocks
    ``b*ratio .. b*ratio+ratio-1`` (vLLM's own ``group_kernel_blocks``), so grouping is a
    view ``[num_blocks, ratio, ...]``: a page is then all of a block's kernel blocks. A
    view whose block count is not a multiple of the engine's is refused, never copied."""
    out = []
    for t in layers:
        rows = int(t.shape[0])
        if rows == num_blocks:
            out.append(t)
        elif num_blocks > 0 and rows > num_blocks and rows % num_blocks == 0:
            out.append(t.unflatten(0, (num_blocks, rows // num_blocks)))
        else:
            raise ValueError(
                f"kvdisk: a KV cache view has {rows} blocks, which is not a whole number of "
                f"kernel blocks per each of the engine's {num_blocks} blocks; its pages "
                "cannot be addressed by block id"
            )
    return out


def block_pages(value: torch.Tensor | Sequence[torch.Tensor], num_blocks: int) -> torch.Tensor:
    """One layer's blocks as raw bytes, ``[num_blocks, page_bytes]``: block ``b`` is the
    ``page_bytes`` from its first byte, whatever views vLLM made of it.

    For models with Mamba / linear-attention state groups: vLLM hands a state layer as
    views of its state tensors (or one byte view of them) carved out of each block's page
    (padded to the attention page), and lays the attention layers beside them block-outer,
    so a block's bytes are one run of the page size in every layer. Copying that run whole
    copies the state (or the K/V page) exactly. A view whose blocks do not lie in runs of
    one stride (a layout kvdisk cannot address by block) is refused."""
    tensors: list[torch.Tensor] = (
        list(value) if isinstance(value, (list, tuple)) else [cast(torch.Tensor, value)]
    )
    if not tensors or num_blocks < 1:
        raise ValueError("kvdisk: an empty KV cache layer")
    storage = tensors[0].untyped_storage()
    starts, page = [], 0
    for t in tensors:
        rows, size = int(t.shape[0]), t.element_size()
        if t.untyped_storage().data_ptr() != storage.data_ptr() or rows % num_blocks:
            raise ValueError("kvdisk: a KV cache layer's views are not blocks of one buffer")
        stride = (
            int(t.stride(0)) * size * (rows // num_blocks)
        )  # a kernel-block split: whole blocks
        extent = size * (1 + sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:])))
        if min(t.stride()) < 0 or page not in (0, stride) or extent > int(t.stride(0)) * size:
            raise ValueError(
                "kvdisk: a KV cache layer is not laid out block by block, so its "
                "pages cannot be copied by block id"
            )
        page = stride
        starts.append((t.storage_offset() * size, extent))
    base = min(a for a, _ in starts)
    if any(a + n > base + page for a, n in starts) or base + num_blocks * page > storage.nbytes():
        raise ValueError("kvdisk: a KV cache layer's state does not fit one page per block")
    raw = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
    return raw.set_(storage, base, (num_blocks, page), (page, 1))


class CudaStreams:
    """The few CUDA calls the page copies make, in one place (tests replace it with a
    recorder, since no GPU runs them here).

    * An I/O thread sets the device before its first CUDA call: otherwise every rank but
      0 creates a context on GPU 0.
    * The compute stream is the one current on the engine thread when the caches are
      registered; copies run on a side stream that first waits on it, so a gather sees
      the forward's writes and a load never overwrites blocks the last step still reads.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)
        self._local = threading.local()

    def enter_thread(self) -> None:
        if not getattr(self._local, "ready", False):
            torch.cuda.set_device(self.device)
            self._local.ready = True

    def mark(self) -> torch.cuda.Event:
        """An event after the work queued on the compute stream so far (the forward)."""
        event = torch.cuda.Event()
        event.record(self.compute)
        return event

    def after_compute(self, event: torch.cuda.Event | None = None) -> None:
        if event is not None:
            self.side.wait_event(event)
        else:
            self.side.wait_stream(self.compute)

    def on_side(self) -> AbstractContextManager:
        return torch.cuda.stream(self.side)

    def finish(self) -> None:
        self.side.synchronize()


class PageMover:
    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        block_size: int,
        layout_name: str,
        *,
        num_blocks: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        host_copies: bool = True,
        streams: CudaStreams | None = None,
    ):
        """``num_blocks``: the engine's block count from its KV cache config (0: the
        views' own). ``host_copies=False`` forces the torch page path a device uses."""
        if not layers:
            raise ValueError("kvdisk: no KV cache layers registered")
        layers = group_kernel_blocks(layers, num_blocks or int(layers[0].shape[0]))
        first = layers[0]
        self.device = first.device
        self.num_blocks = first.shape[0]
        for t in layers:
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
                raise ValueError("kvdisk: layers with different KV shapes are not supported")
        self.layout = PageLayout(
            layout_name,
            block_size,
            len(layers),
            tuple(first.shape[1:]),
            dtype_name(first.dtype),
            tp_rank,
            tp_size,
        )
        self.layout.validate()
        # Logical per-layer tensors, block dimension first. Indexing dim 0 copies exactly
        # one block's logical contents whatever the physical strides are.
        self._layers = list(layers)
        self.page_bytes = self.layout.page_bytes
        # Host-resident contiguous layers (the CPU backend): plain byte views, so copies
        # are numpy row copies with no allocation at all.
        self._host: list[np.ndarray] | None = None
        self._host_bytes: list[memoryview] = []  # each layer as one flat byte view
        if host_copies and self.device.type == "cpu" and all(t.is_contiguous() for t in layers):
            self._host = [t.view(torch.uint8).reshape(self.num_blocks, -1).numpy() for t in layers]
            self._host_bytes = [a.data.cast("B") for a in self._host]
        self._cuda = (
            streams
            if streams is not None
            else (CudaStreams(self.device) if self.device.type == "cuda" else None)
        )

    def _ids(self, block_ids: Sequence[int]) -> np.ndarray:
        """Block ids as int64, every one checked to name a block of this cache."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"block id outside 0..{self.num_blocks - 1}")
        return ids

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Block ids as a tensor on the cache's device; on a GPU call it inside the side
        stream's context, so the upload is ordered with the copy that uses it."""
        ids = torch.from_numpy(self._ids(block_ids))
        return ids.to(self.device, non_blocking=True) if self._cuda is not None else ids

    def mark(self) -> object | None:
        """On a GPU, an event after the work queued so far on the compute stream (call it
        on the engine thread after the forward; pass it to ``gather`` from any thread)."""
        return self._cuda.mark() if self._cuda is not None else None

    def gather(
        self, block_ids: Sequence[int], out: Sequence[np.ndarray], after: object | None = None
    ) -> None:
        """Copy the pages of ``block_ids`` of every layer into ``out`` (one uint8 array of
        len(block_ids) x page_bytes per layer, e.g. from a StagingPool). ``after``: a
        ``mark()``; without one the copy waits for everything queued on the compute
        stream."""
        self.gather_layers([block_ids] * len(self._layers), out, after)

    def gather_layers(
        self,
        block_ids: Sequence[Sequence[int]],
        out: Sequence[np.ndarray],
        after: object | None = None,
        layers: Sequence[int] | None = None,
    ) -> None:
        """``gather`` with each layer's own block ids (the layers of a hybrid model's KV
        cache groups have a block table each); ``layers``: only these layers, in this
        order (``block_ids`` and ``out`` then hold one item per layer named)."""
        layers = range(len(self._layers)) if layers is None else layers
        if len(block_ids) != len(layers) or len(out) != len(layers):
            raise ValueError("one block id list and one buffer per layer are needed")
        checked: dict[int, np.ndarray] = {}  # one check per group's list, not per layer
        if self._host is not None:
            for src, ids, dst in zip((self._host[i] for i in layers), block_ids, out):
                if id(ids) not in checked:
                    checked[id(ids)] = self._ids(ids)
                # mode="clip": ids are checked, and "raise" buffers the output
                # (measured: half the speed of a plain copy instead of 0.8).
                np.take(
                    src,
                    checked[id(ids)],
                    axis=0,
                    out=dst.reshape(len(ids), self.page_bytes),
                    mode="clip",
                )
            return
        cuda = self._cuda
        if cuda is not None:
            cuda.enter_thread()
            # the forward that wrote these blocks comes first
            cuda.after_compute(cast("torch.cuda.Event | None", after))
        step = self._piece_blocks()
        with cuda.on_side() if cuda is not None else nullcontext():
            index: dict[int, torch.Tensor] = {}
            for t, ids, dst in zip((self._layers[i] for i in layers), block_ids, out):
                if id(ids) not in index:  # one upload per group's list, not per layer
                    index[id(ids)] = self._index(ids)
                idx, n = index[id(ids)], len(ids)
                rows = torch.from_numpy(dst).reshape(n, -1)
                for a in range(0, n, step):  # the device temporary: one piece at a time
                    piece = torch.index_select(t, 0, idx[a : a + step]).contiguous()
                    # Into pinned staging: asynchronous, ordered on the side stream, which
                    # also orders the piece's memory for reuse by the next one.
                    rows[a : a + step].copy_(
                        piece.view(torch.uint8).reshape(len(piece), -1),
                        non_blocking=cuda is not None,
                    )
        if cuda is not None:
            cuda.finish()  # the blocks may be freed as soon as this returns

    def _piece_blocks(self) -> int:
        """Blocks per device copy: a piece of one layer's pages within the transient cap."""
        return max(1, DEVICE_TRANSIENT_BYTES // self.page_bytes)

    @property
    def host_resident(self) -> bool:
        """True when the cache lives in host memory (CPU backend): files can be read
        straight into the blocks (``block_runs`` + ``host_views``), no staging copy."""
        return self._host is not None

    def block_runs(self, block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """``block_ids`` as runs of consecutive ids ``(first, count)``, in the given order
        (the same for every layer: compute once per file)."""
        ids = self._ids(block_ids)
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), int(ids.size)]
        return [(int(ids[a]), b - a) for a, b in zip(starts, ends) if b > a]

    def host_views(self, layer: int, runs: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Byte views of one layer's pages for ``runs`` (from ``block_runs``)."""
        if self._host is None:
            raise RuntimeError("the KV cache is not host-resident")
        # Slices of one flat byte view: a numpy slice, reshape and memoryview per run cost
        # ~5x more (1.2-1.7 ms for 312 runs x 8 layers, on the restore's critical path).
        # Runs come from block_runs (ids checked); a slice past the end would come out
        # short, and read_layers_into refuses buffers of the wrong size.
        flat, pb = self._host_bytes[layer], self.page_bytes
        return [flat[first * pb : (first + count) * pb] for first, count in runs]

    def scatter(self, layer: int, block_ids: Sequence[int], pages: np.ndarray) -> None:
        """Write host ``pages`` (n x page_bytes bytes) into blocks ``block_ids`` of one layer."""
        n = len(block_ids)
        if self._host is not None:
            self._host[layer][self._ids(block_ids)] = pages.reshape(n, self.page_bytes)
            return
        target = self._layers[layer]
        src = torch.from_numpy(pages).reshape(-1).view(target.dtype).reshape(n, *target.shape[1:])
        cuda = self._cuda
        if cuda is not None:
            cuda.enter_thread()  # an I/O thread: set the device, or it opens a context on GPU 0
            cuda.after_compute()  # blocks just allocated may still be read by the last step
        step = self._piece_blocks()
        with cuda.on_side() if cuda is not None else nullcontext():
            idx = self._index(block_ids)
            for a in range(0, n, step):  # the uploaded piece is the device temporary
                target.index_copy_(
                    0, idx[a : a + step], src[a : a + step].to(self.device, non_blocking=True)
                )
        if cuda is not None:
            cuda.finish()
