"""Device buffers shared by two processes of one node (CUDA IPC), for the shared-memory channels.

A "cuda-ipc" channel is a shared-memory channel (shm.py: the same doorbell, the same frames)
whose two regions live in the attention worker's GPU memory instead of a memfd: the client
allocates them, sends their IPC handle in the handshake (`IpcHandle.encode`: fixed fields and
length-prefixed bytes, no pickle), and the expert worker opens them on its own GPU. Rows never
touch host memory: the client's gather writes the request region, the expert's kernels read it
and write the response region, the client's sum reads that.

Ordering: the client synchronises its current stream before it rings the doorbell (its writes
are done), the expert synchronises its stream after the compute and before it answers (its
writes are done); neither reads before the other's kernels have written.

Devices: Ray gives every actor its own CUDA_VISIBLE_DEVICES, so device indices differ between
processes; the handshake names the GPU by its UUID and the expert worker opens the buffer on the
device that has it (or refuses the channel, with the reason, where that GPU is not visible to it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

_FIXED = struct.Struct("<16sQQQ?HHH")  # GPU uuid, size, offset, ref counter offset, event sync, 3 lengths
MAX_HANDLE_BYTES = 4096


def available() -> bool:
    return torch.cuda.is_available()


def gpu_uuid(device: torch.device) -> bytes:
    """The 16 bytes of a GPU's UUID (the same in every process of the node)."""
    return torch.cuda.get_device_properties(device).uuid.bytes


def local_device(uuid: bytes) -> torch.device | None:
    """The device of this process with that GPU UUID; None where it is not visible here."""
    if not available():
        return None
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", i)) == uuid:
            return torch.device("cuda", i)
    return None


@dataclass(frozen=True)
class IpcHandle:
    """What `UntypedStorage._share_cuda_` gives for one allocation, with the GPU named by UUID."""

    uuid: bytes  # 16 bytes
    handle: bytes  # cudaIpcMemHandle of the allocation
    size: int  # bytes of the storage
    offset: int  # of the storage in the allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def encode(self) -> bytes:
        fields = (self.handle, self.ref_counter_handle, self.event_handle)
        head = _FIXED.pack(self.uuid, self.size, self.offset, self.ref_counter_offset, self.event_sync_required,
                           *(len(f) for f in fields))  # fmt: skip
        return head + b"".join(fields)

    @classmethod
    def decode(cls, data: bytes) -> tuple[IpcHandle, bytes]:
        """(the handle at the start of `data`, the bytes after it); ValueError if malformed."""
        if len(data) < _FIXED.size:
            raise ValueError(f"an IPC handle of {len(data)} bytes")
        uuid, size, offset, counter_offset, sync, *lengths = _FIXED.unpack_from(data)
        end = _FIXED.size + sum(lengths)
        if sum(lengths) > MAX_HANDLE_BYTES or len(data) < end:
            raise ValueError(f"an IPC handle claiming {sum(lengths)} bytes, {len(data) - _FIXED.size} given")
        parts, at = [], _FIXED.size
        for n in lengths:
            parts.append(bytes(data[at : at + n]))
            at += n
        handle, counter, event = parts
        return cls(uuid, handle, size, offset, counter, counter_offset, event, sync), data[end:]


def share(region: torch.Tensor) -> IpcHandle:
    """The IPC handle of `region` (a whole uint8 CUDA storage: storage offset 0)."""
    if region.storage_offset() != 0 or region.untyped_storage().nbytes() != region.numel():
        raise ValueError("share a whole storage")
    device, handle, size, offset, counter, counter_offset, event, sync = (
        region.untyped_storage()._share_cuda_()
    )
    return IpcHandle(
        gpu_uuid(region.device), handle, size, offset, counter, counter_offset, event, bool(sync)
    )


def open_region(h: IpcHandle) -> torch.Tensor:
    """The peer's region as a uint8 tensor on the device that holds it; OSError with the reason
    where that GPU is not visible to this process."""
    device = local_device(h.uuid)
    if device is None:
        raise OSError("the attention worker's GPU is not visible to this expert worker")
    storage = torch.UntypedStorage._new_shared_cuda(device.index, h.handle, h.size, h.offset,
                                                    h.ref_counter_handle, h.ref_counter_offset,
                                                    h.event_handle, h.event_sync_required)  # fmt: skip
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`'s current stream (before a doorbell or an answer)."""
    torch.cuda.current_stream(device).synchronize()
