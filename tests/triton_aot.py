"""Compile every Triton kernel launch the GPU path makes for NVIDIA GPUs, on a machine without one.

    python -m tests.triton_aot [--arch 90,80]      # (TRITON_INTERPRET unset) -> one JSON line per launch

Triton's interpreter (how CI runs the kernels) executes the Python of a kernel; it never builds the
GPU code, so it misses what only the compiler sees: a type or layout the code generator rejects,
shared memory past an SM's limit, register spills. Here each wrapper (`triton_mla.mla_decode`,
`triton_moe.fused_moe`, `triton_norm.rms_norm`, `triton_linear.fp8_linear`) runs on CPU tensors
at the shapes the engine gives it (DeepSeek-V3's, and V3.2's sparse MLA) with `JITFunction.run`
recording its launches instead of running them; each launch is then specialised by triton's own
binder (argument types, 16-byte alignment, as a launch on a GPU would be) and compiled through
ptxas for the target (sm_90: H100/H200; sm_80: A100), and its cubin's resource usage read back
with cuobjdump (both ship with triton's wheel). tests/test_triton_compile.py checks the results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# the targets we compile for: largest dynamic shared memory per block (bytes), multiprocessors
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
SMS = {90: 132, 80: 108}  # (H100 SXM, A100)


def cases() -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call of a kernel wrapper) at the shapes the engine launches. Weights are
    torch.empty: the launches are recorded, never run, so their values are never read."""
    import torch

    from services.model.kernels import triton_linear, triton_mla, triton_moe, triton_norm

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    heads, latent, rope = 128, 512, 64  # DeepSeek-V3's absorbed MLA decode

    def mla(dtype, splits, width=latent + rope, sparse=False, tiles=None, fp8_rows=False):
        q = torch.empty(2, heads, latent + rope, dtype=dtype)
        cache = torch.empty(8, 64, 1, width, dtype=torch.uint8 if fp8_rows else dtype)
        lens = torch.tensor([100, 300])
        if sparse:  # V3.2: each row's top-k cache rows (the indexer's keys widen the rows)
            rows = torch.zeros(2, 2048, dtype=torch.int64)
            return lambda: triton_mla.mla_decode(q, cache, None, lens, latent, 0.1, splits, rows=rows)
        table = torch.zeros(2, 64, dtype=torch.int64)
        return lambda: triton_mla.mla_decode(q, cache, table, lens, latent, 0.1, splits, tiles=tiles)

    for dtype in (bf16, torch.float16, torch.float32):
        for splits in (1, 64):  # long batches / one sequence of 4k tokens on 132 SMs
            yield f"mla {str(dtype)[6:]} splits={splits}", mla(dtype, splits)
    yield "mla bfloat16 sparse (V3.2)", mla(bf16, 8, width=latent + rope + 128, sparse=True)
    for splits in (1, 4):  # Hopper's tiles at batches of 8 and more, and prefill (decode_tiles)
        yield f"mla bfloat16 wide tiles splits={splits}", mla(bf16, splits, tiles=triton_mla.WIDE_TILES)
    # the FP8 cache's 656-byte rows: 16-head tiles, and what decode_tiles picks (wide tiles on sm_90)
    yield "mla fp8 rows 16 heads", mla(bf16, 4, width=656, tiles=triton_mla.FP8_TILES, fp8_rows=True)
    yield "mla fp8 rows", mla(bf16, 4, width=656, fp8_rows=True)

    def latent_to_cache(dtype, interleave=True):  # the per-token work: latent norm, ropes, cache write
        kv, q = torch.empty(2, latent + rope, dtype=dtype), torch.empty(2, heads, 128 + rope, dtype=dtype)
        norm, cos, sin = (
            torch.empty(latent, dtype=dtype),
            torch.empty(2, 32, dtype=dtype),
            torch.empty(2, 32, dtype=dtype),
        )
        cache, slots = torch.empty(8, 64, 1, latent + rope, dtype=dtype), torch.zeros(2, dtype=torch.int64)
        return lambda: triton_mla.latent_to_cache(
            kv, q[..., 128:], norm, cos, sin, slots, cache, interleave, 1e-6
        )

    for dtype in (bf16, torch.float32):
        yield f"mla latent_to_cache {str(dtype)[6:]}", latent_to_cache(dtype)
    yield "mla latent_to_cache bfloat16 halves", latent_to_cache(bf16, interleave=False)

    def moe(tokens, dtype=bf16, fp8_weights=False, limit=None, S=32, H=7168, I=2048, K=8):
        x = torch.empty(tokens, H, dtype=dtype)
        slot = torch.randint(0, S, (tokens, K))
        weight = torch.rand(tokens, K)
        if not fp8_weights:
            w13, w2 = torch.empty(S, 2 * I, H, dtype=dtype), torch.empty(S, H, I, dtype=dtype)
            return lambda: triton_moe.fused_moe(x, slot, weight, w13, w2, limit)
        w13, w2 = torch.empty(S, 2 * I, H, dtype=fp8), torch.empty(S, H, I, dtype=fp8)
        s13, s2 = torch.empty(S, 2 * I // 128, H // 128), torch.empty(S, H // 128, I // 128)
        return lambda: triton_moe.fused_moe(x, slot, weight, w13, w2, limit, s13, s2, (128, 128))

    for tokens in (1, 512):  # decode (16-row tiles) and prefill (64-row tiles)
        yield f"moe bf16 tokens={tokens}", moe(tokens)
        yield f"moe fp8 tokens={tokens}", moe(tokens, fp8_weights=True)
    yield "moe float32 tokens=1", moe(1, dtype=torch.float32, S=8, H=1024, I=256)
    yield "moe bf16 swiglu_limit (V4)", moe(1, limit=10.0)

    for dtype, width in ((bf16, 7168), (bf16, 512), (torch.float32, 7168)):
        x, w = torch.empty(4, width, dtype=dtype), torch.empty(width, dtype=dtype)
        yield f"rms_norm {str(dtype)[6:]} {width}", lambda x=x, w=w: triton_norm.rms_norm(x, w, 1e-6)
        yield (
            f"add_rms_norm {str(dtype)[6:]} {width}",
            lambda x=x, w=w: triton_norm.add_rms_norm(x, x, w, 1e-6),
        )

    def linear(tokens, out, inp, dtype=bf16, splits=None, bias=False):
        x = torch.empty(tokens, inp, dtype=dtype)
        w, scale = torch.empty(out, inp, dtype=fp8), torch.empty(-(-out // 128), -(-inp // 128))
        b = torch.empty(out, dtype=dtype) if bias else None
        return lambda: triton_linear.fp8_linear(x, w, scale, (128, 128), b, splits)

    for name, out, inp in (
        ("q_a", 1536, 7168),
        ("kv_a", 576, 7168),
        ("q_b", 24576, 1536),
        ("o", 7168, 16384),
    ):
        for tokens in (1, 512):  # (K split to fill the GPU: kv_a 16 ways at decode, q_b not at all)
            yield f"fp8_linear {name} tokens={tokens}", linear(tokens, out, inp)
    yield "fp8_linear float32 bias", linear(8, 1536, 7168, dtype=torch.float32, bias=True)

    # --deterministic's batch-invariant launches (kernels/deterministic.py): one configuration
    # whatever the batch, so one case each covers every batch size
    q, cache, lens = torch.empty(2, heads, latent + rope, dtype=bf16), torch.empty(8, 64, 1, latent + rope, dtype=bf16), torch.tensor([100, 300])  # fmt: skip
    table = torch.zeros(2, 64, dtype=torch.int64)
    yield (
        "mla bfloat16 deterministic wide tiles",
        lambda: triton_mla.mla_decode(q, cache, table, lens, latent, 0.1, deterministic=True),
    )
    x, w, s = torch.empty(4, 7168, dtype=bf16), torch.empty(1536, 7168, dtype=fp8), torch.empty(12, 56)
    yield (
        "fp8_linear deterministic q_a",
        lambda: triton_linear.fp8_linear(x, w, s, (128, 128), deterministic=True),
    )
    slot, weight = torch.randint(0, 32, (4, 8)), torch.rand(4, 8)
    w13, w2 = torch.empty(32, 4096, 7168, dtype=bf16), torch.empty(32, 7168, 2048, dtype=bf16)
    yield "moe bf16 deterministic", lambda: triton_moe.fused_moe(x, slot, weight, w13, w2, deterministic=True)
    for dtype in (bf16, torch.float16, torch.float32):
        xs, ws = torch.empty(4, 7168, dtype=dtype), torch.empty(1536, 7168, dtype=dtype)
        yield f"linear deterministic {str(dtype)[6:]}", lambda xs=xs, ws=ws: triton_linear.linear(xs, ws)
    xs, ws = torch.empty(4, 7168), torch.empty(1536, 7168, dtype=bf16)  # (bf16 weights under fp32)
    yield "linear deterministic float32 bf16 weights", lambda: triton_linear.linear(xs, ws)
    q_nope, kv_b = torch.empty(heads, 4, 128, dtype=bf16), torch.empty(heads, latent, 128, dtype=bf16)
    yield "absorb deterministic bfloat16", lambda: triton_linear.batched_linear(q_nope, kv_b)


def record_launches(call: Callable[[], object], arch: int) -> list[tuple[object, tuple, dict]]:
    """The (JITFunction, args, kwargs) of every launch `call` makes for an sm_<arch> GPU (its
    multiprocessors; the FP8 kernels read uint8 bytes below sm_89); none of them runs."""
    from triton.runtime.jit import JITFunction

    from services.model.kernels import hardware

    launches = []

    def record(self, *args, grid, warmup=False, **kwargs):
        launches.append((self, args, kwargs))

    saved = JITFunction.run, hardware.fp8_native, hardware.multiprocessors, hardware.hopper_or_newer
    JITFunction.run, hardware.fp8_native = record, lambda t: arch >= 89
    hardware.multiprocessors = lambda _: SMS[arch]  # (the split heuristics' input)
    hardware.hopper_or_newer = lambda _: arch >= 90  # (decode_tiles' choice)
    try:
        call()
    finally:
        JITFunction.run, hardware.fp8_native, hardware.multiprocessors, hardware.hopper_or_newer = saved
    return launches


def compile_launch(fn, args: tuple, kwargs: dict, arch: int) -> dict:
    """Compile one recorded launch for sm_<arch> as a launch on that GPU would (triton's binder:
    the same signature, constants and specialisations) -> its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    start = time.perf_counter()
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
    )
    return {"kernel": fn.__name__, "arch": arch, "shared": kernel.metadata.shared,
            "compile_s": round(time.perf_counter() - start, 2), **resource_usage(kernel.asm["cubin"])}  # fmt: skip


def resource_usage(cubin: bytes) -> dict:
    """{"registers", "local"} of a cubin's kernel, from `cuobjdump -res-usage` (local memory > 0:
    registers spilled, or a stack array)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    return {"registers": int(usage[1]), "stack": int(usage[2]), "local": int(usage[3])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90,80", help="compute capabilities to compile for")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter builds no GPU code")
    for arch in (int(a) for a in args.arch.split(",")):
        for label, call in cases():
            launches = record_launches(call, arch)
            if not launches:  # (a wrapper that declined these inputs)
                print(json.dumps({"case": label, "arch": arch, "kernel": None, "error": "nothing launched"}))
            for fn, fargs, fkwargs in launches:
                try:
                    result = compile_launch(fn, fargs, dict(fkwargs), arch)
                except Exception as e:  # reported, so that one failure does not hide the others
                    result = {"kernel": fn.__name__, "arch": arch, "error": f"{type(e).__name__}: {e}"[-500:]}
                print(json.dumps({"case": label, **result}), flush=True)


if __name__ == "__main__":
    main()
