"""The cuda-ipc transport (services/dataplane/cuda_ipc.py, shm.py's device channels): on the CPU,
the handle's codec, the handshake a CPU expert worker refuses with its reason (and goes on
serving), and the choice's rules; with a GPU, two processes exchanging rows through device
buffers, answers equal to the host channel's, and a killed worker seen at once."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from services.dataplane import cuda_ipc, frames, shm
from services.dataplane.transport import Transports

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HANDLE = cuda_ipc.IpcHandle(
    uuid=bytes(range(16)),
    handle=b"\x01" * 64,
    size=1 << 20,
    offset=512,
    ref_counter_handle=b"/torch_123_456",
    ref_counter_offset=7,
    event_handle=b"\x02" * 64,
    event_sync_required=True,
)


def test_an_ipc_handle_travels_as_bytes_and_a_malformed_one_is_refused():
    data = HANDLE.encode() + b"the secret"
    handle, rest = cuda_ipc.IpcHandle.decode(data)
    assert handle == HANDLE and rest == b"the secret"
    for bad in (data[:10], data[: len(HANDLE.encode()) - 1]):
        with pytest.raises(ValueError, match="IPC handle"):
            cuda_ipc.IpcHandle.decode(bad)
    assert cuda_ipc.local_device(b"\xff" * 16) is None  # (no such GPU here)


def _identity(layer, version, hidden, slot, weight, out):
    out.copy_(hidden * 2)
    return 0.0


@pytest.fixture
def cpu_server():
    address = f"cuda-ipc-test-{os.getpid()}-{time.monotonic_ns()}:1"
    server = shm.ShmServer(address, _identity, lambda e: grpc.StatusCode.INTERNAL, secret="s")
    yield address, server
    server.close()


def _hello(address: str, capacity: int, handle: bytes, secret: bytes):
    """A device channel's hello, sent by hand (no GPU here to make a real handle)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(shm.abstract_address(address))
    sock.send(shm._HELLO.pack(shm.MAGIC_CUDA, capacity) + handle + secret)
    return sock


def test_a_cpu_worker_refuses_a_device_channel_with_its_reason_and_serves_on(cpu_server):
    address, server = cpu_server
    sock = _hello(address, 1 << 16, HANDLE.encode(), b"s")  # (the secret right: refused for the device alone)
    ack = sock.recv(shm._ACK.size + frames.MAX_ERROR_BYTES)
    assert shm._ACK.unpack_from(ack) == (shm.MAGIC, shm.NOT_HERE)
    assert b"computes on the CPU" in ack[shm._ACK.size :]
    with pytest.raises(OSError, match="computes on the CPU"):
        shm._check_ack(ack)
    sock.close()
    refused = server.refused
    sock = _hello(address, 1 << 16, HANDLE.encode(), b"wrong")  # (a wrong secret: closed, counted)
    assert sock.recv(64) == b""
    sock.close()
    sock = _hello(address, 1 << 16, HANDLE.encode()[:20], b"s")  # (a torn handle: closed)
    assert sock.recv(64) == b""
    sock.close()
    deadline = time.monotonic() + 10
    while server.refused != refused + 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    channel = shm.ShmChannel.connect(address, 1 << 16, secret="s")  # a host channel still works
    hidden, slot, weight = channel.request(2, 4, 1, torch.float32)
    hidden.copy_(torch.arange(8.0).view(2, 4))
    channel.send(0, 1)
    assert torch.equal(channel.result(10)[0], torch.arange(8.0).view(2, 4) * 2)
    channel.close()


def test_cuda_ipc_is_chosen_only_from_a_gpu():
    assert "cuda-ipc" not in Transports("auto", 5.0, 1 << 20).preference
    assert Transports("auto", 5.0, 1 << 20, device="cuda:0").preference[0] == "cuda-ipc"
    with pytest.raises(ValueError, match="not a GPU"):
        Transports("cuda-ipc", 5.0, 1 << 20, device="cpu")


SERVER = """
import sys, time, grpc, torch
from services.dataplane import shm
def compute(layer, version, hidden, slot, weight, out):
    assert hidden.is_cuda and out.is_cuda  # (the rows never came through the host)
    if layer == 1:
        time.sleep(60)  # killed meanwhile
    out.copy_(hidden * 2 + weight.sum(1, keepdim=True).to(hidden.dtype))
    return 0.0
server = shm.ShmServer(sys.argv[1], compute, lambda e: grpc.StatusCode.INTERNAL, device="cuda")
print("ready", flush=True)
time.sleep(120)
"""


@needs_gpu
def test_rows_stay_on_the_gpu_between_two_processes():
    address = f"cuda-ipc-{os.getpid()}:1"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, address], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        channel = shm.ShmChannel.connect(address, 1 << 20, device="cuda")
        assert channel.device.type == "cuda"
        for T in (1, 7, 64):
            hidden, slot, weight = channel.request(T, 256, 2, torch.bfloat16)
            x, w = torch.randn(T, 256, device="cuda").bfloat16(), torch.rand(T, 2, device="cuda")
            hidden.copy_(x)
            slot.zero_()
            weight.copy_(w)
            channel.send(0, 1)
            out, _ = channel.result(30)
            assert out.is_cuda and torch.equal(out, x * 2 + w.sum(1, keepdim=True).bfloat16())
        channel.request(2, 256, 2, torch.bfloat16)
        channel.send(1, 1)  # the worker sleeps in this one
        threading.Timer(0.3, os.kill, (proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(frames.TransportError) as e:
            channel.result(60)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 10
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_on_part_of_a_gpu_is_held_to_its_share():
    from services.gpus import gpu_share, limit_gpu_memory

    assert gpu_share({"GPU": 0.25, "CPU": 1.0}) == 0.25
    assert (
        gpu_share({"GPU": 1.0}) is None
        and gpu_share({"CPU": 2.0}) is None
        and gpu_share({"GPU": 2.0}) is None
    )
    if not torch.cuda.is_available():
        assert limit_gpu_memory() is None  # (nothing to cap on the CPU, and no Ray touched)
