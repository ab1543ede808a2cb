"""A step's host tensors reach the device in one copy.

Every tensor a step sends (token ids, positions, slot mapping, block tables, sampling
parameters) is packed into one pinned host buffer, copied with one non-blocking
transfer, and unpacked on the device as views of that one buffer. Copied one by one from
pageable memory, each small tensor was its own synchronous transfer (~200 a decode step
on an H200, the device idle in between). Buffers rotate, and a buffer is refilled only
once the copy that last read it has finished (a CUDA event), so steps in flight never see
their inputs overwritten.
"""

from __future__ import annotations

import dataclasses

import torch

ALIGN = 16  # bytes: every dtype's views start aligned


class Staging:
    def __init__(self, device: torch.device, num_buffers: int = 4):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None] * num_buffers
        self.copied: list[torch.cuda.Event | None] = [None] * num_buffers
        self.turn = 0
        self.copies = 0  # host-to-device transfers made (tests count them)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        i = self.turn = (self.turn + 1) % len(self.buffers)
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # the copy that last read this buffer is done
        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[i] = torch.empty(max(nbytes, 2 * (0 if buf is None else buf.numel()), 1 << 16),
                                                dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return buf

    def send(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The same tensors on the device, after one host-to-device copy."""
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        if not tensors or end == 0:
            return [t.to(self.device) for t in tensors]
        host = self._buffer(end)
        for t, off in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            if n:
                host[off : off + n].view(t.dtype).view(t.shape).copy_(t)
        device = host[:end].to(self.device, non_blocking=True)
        self.copies += 1
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.copied[self.turn] = event
        return [device[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for t, off in zip(tensors, offsets)]

    def send_fields(self, *objects):
        """Copies of dataclass objects (None passes through) whose tensor fields are on the device."""
        present = [o for o in objects if o is not None]
        names = [[k for k, v in vars(o).items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"] for o in present]
        moved = iter(self.send([getattr(o, k) for o, ks in zip(present, names) for k in ks]))
        out = iter([dataclasses.replace(o, **{k: next(moved) for k in ks}) for o, ks in zip(present, names)])
        return [None if o is None else next(out) for o in objects]
