"""Checkpoint tensors to the device through reusable pinned staging buffers.

A host-to-device copy runs at the link's rate only from pinned (page-locked) memory. Pinning each
checkpoint tensor on its way (`tensor.pin_memory()`) page-locks fresh memory for every tensor, which
costs more than the copy itself (2.5 GB of a 1B checkpoint: seconds). Here every loading thread owns two
pinned buffers of `chunk_bytes`, allocated once, and its own stream: a tensor's bytes go through them
chunk by chunk, the CPU filling one buffer (reading the memory-mapped file: the page cache, or the disk)
while the other's copy to the device runs. A buffer is refilled only after its previous copy completed
(an event), and `to_device` returns once the tensor's last copy completed, so the result is whole for any
stream.
"""

from __future__ import annotations

import threading

import torch

CHUNK_BYTES = 16 << 20


class PinnedStaging:
    """Per-thread staging for copies of host tensors to `device` (module docstring).

    Args:
        device: where `to_device` puts tensors; a CPU device copies through unpinned buffers (the same
            chunking, for tests).
        chunk_bytes: bytes per staging buffer; each thread that calls `to_device` holds two.
    """

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.device = device
        self.chunk_bytes = chunk_bytes
        self._local = threading.local()

    def _thread_state(self) -> tuple[list[torch.Tensor], torch.cuda.Stream | None, list]:
        state = getattr(self._local, "state", None)
        if state is None:
            cuda = self.device.type == "cuda"
            buffers = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
            stream = torch.cuda.Stream(self.device) if cuda else None
            state = self._local.state = (buffers, stream, [None, None])
        return state

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of the host `tensor` on the device, complete when this returns."""
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        n = tensor.numel() * tensor.element_size()
        if n == 0:
            return out
        src = tensor.contiguous().reshape(-1).view(torch.uint8)
        dst = out.reshape(-1).view(torch.uint8)
        buffers, stream, done = self._thread_state()
        for i, start in enumerate(range(0, n, self.chunk_bytes)):
            k = i % 2
            if done[k] is not None:
                done[k].synchronize()  # the buffer's previous copy has read it
            m = min(self.chunk_bytes, n - start)
            buffers[k][:m].copy_(src[start : start + m])
            if stream is None:
                dst[start : start + m].copy_(buffers[k][:m])
                continue
            with torch.cuda.stream(stream):
                dst[start : start + m].copy_(buffers[k][:m], non_blocking=True)
                done[k] = torch.cuda.Event()
                done[k].record(stream)
        if stream is not None:
            stream.synchronize()
            done[0] = done[1] = None
        return out
