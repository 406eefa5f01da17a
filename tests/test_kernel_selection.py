"""Kernels chosen once (services/model/kernels/select.py): on this machine every family of the
model's work names its kernel and says why each better one was not taken; a model shape a
kernel cannot take is refused when the kernels are selected, with the reason; the engine logs
the choice at startup and shows it in its stats, the expert store in its own."""

import logging
import os

import pytest
import torch

from services.model.config import ModelConfig
from services.model.kernels import cpu_kernels
from services.model.kernels.select import IMPLEMENTATIONS, families_of, select_kernels
from services.presets import PRESETS

CPP = cpu_kernels.available()


def _cfg(preset: str = "tiny", **overrides) -> ModelConfig:
    return ModelConfig.from_hf({**PRESETS[preset], **overrides})


def _better(name: str, candidates) -> list[str]:
    """The implementations ranked above `name` among `candidates` (IMPLEMENTATIONS' order)."""
    order = [n for n in IMPLEMENTATIONS if n in candidates]
    return order[: order.index(name)] if name in order else order


@pytest.mark.parametrize("preset", ["tiny", "tiny-v32", "tiny-v4"])
def test_this_cpu_names_each_familys_kernel_and_why_not_the_better_ones(preset):
    cfg = _cfg(preset)
    k = select_kernels("cpu", torch.float32, cfg)
    names, reasons = k.names(), k.reasons()
    assert list(names) == list(families_of(k.target)) and set(reasons) == set(names)
    for family, name in names.items():
        assert name in (*IMPLEMENTATIONS, "unfused"), (family, name)
        assert all(isinstance(why, str) and why for why in reasons[family].values()), family
        if name in IMPLEMENTATIONS:  # every better implementation that exists for it says why not
            assert "flashmla" not in names.values() and "triton" not in names.values()  # (CPU tensors)
            for better in reasons[family]:
                assert IMPLEMENTATIONS.index(better) < IMPLEMENTATIONS.index(name), (family, better)
    for family in names:
        for gpu in ("triton", "flashmla"):
            if gpu in reasons[family]:
                assert "CPU tensors" in reasons[family][gpu]
    if CPP:  # fp32 on the CPU: the C++ kernels take every family they have
        cpp = {"linear", "expert_ffn", "index_scores", "rms_norm", "add_rms_norm", "rope", "route", "dense_ffn",
               "absorb", "mla_decode"}  # fmt: skip
        assert {f for f, n in names.items() if n == "cpp"} >= cpp & set(names)
        if preset == "tiny":
            assert names["mla_decode_layer"] == "cpp" and names["mla_decode"] == "cpp"
            assert reasons["mla_decode"]["flashmla"].startswith("CPU tensors")
            assert names["latent_to_cache"] == names["mla_prefill"] == "torch"  # (Triton's only)
        if preset == "tiny-v32":
            assert names["mla_decode_layer"] == "unfused"
            assert "V3.2" in reasons["mla_decode_layer"]["cpp"] and names["latent_to_cache"] == "torch"
    else:  # no C++ toolchain: torch everywhere, and the build's reason
        assert set(names.values()) <= {"torch", "unfused"}
        assert all(
            "not built" in r["cpp"] or "MOE_CPU_KERNELS" in r["cpp"] for r in reasons.values() if "cpp" in r
        )
    assert k.summary().startswith("kernels on cpu float32: ") and all(f"{f}={n}" in k.summary()
                                                                     for f, n in names.items())  # fmt: skip


def test_bf16_activations_take_torch_and_say_why():
    k = select_kernels("cpu", torch.bfloat16, _cfg())
    assert set(k.names().values()) == {"torch", "unfused"}
    if CPP:
        assert all(
            "float32 activations only (bfloat16)" in r["cpp"] for r in k.reasons().values() if "cpp" in r
        )


@pytest.mark.skipif(not CPP, reason="no C++ toolchain: no C++ kernel to refuse anything")
def test_a_model_shape_a_kernel_cannot_take_is_refused_at_selection():
    """kv_lora_rank 20 (not a multiple of 8): the C++ norms, absorbed products and decode
    attention refuse it, and the fused decode layer with them; the other C++ kernels still run."""
    k = select_kernels("cpu", torch.float32, _cfg(kv_lora_rank=20))
    names, reasons = k.names(), k.reasons()
    for family in ("rms_norm", "absorb", "mla_decode", "mla_decode_layer"):
        assert names[family] in ("torch", "unfused"), family
        assert "kv_lora_rank 20 is not a multiple of 8" in reasons[family]["cpp"], family
    assert names["add_rms_norm"] == names["dense_ffn"] == names["expert_ffn"] == "cpp"


def test_flashmla_and_triton_refuse_the_shapes_they_cannot_take(monkeypatch):
    """Asked for by name (on CPU tensors: FlashMLA's stand-in, Triton's interpreter), FlashMLA
    refuses any latent but V3's 512 + 64, Triton FP8 rows of a latent that is not a multiple of
    128: at selection, with the reason."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flash_mla", types.ModuleType("flash_mla"))
    k = select_kernels("cpu", torch.bfloat16, _cfg(), allow="flashmla,torch")
    assert k.names()["mla_decode"] == "torch"
    assert k.reasons()["mla_decode"]["flashmla"] == "V3's 512 + 64 latent rows only (this model: 32 + 8)"
    v3 = select_kernels(
        "cpu", torch.bfloat16, _cfg(kv_lora_rank=512, qk_rope_head_dim=64), allow="flashmla,torch"
    )
    assert v3.names()["mla_decode"] == "flashmla" and v3.reasons()["mla_decode"] == {}
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.importorskip("triton")
        k = select_kernels("cpu", torch.float32, _cfg(), allow="triton,torch", fp8_cache=True)
        assert k.names()["mla_decode"] == k.names()["mla_prefill"] == "torch"
        assert "kv_lora_rank % 128" in k.reasons()["mla_decode"]["triton"]
        assert "FP8 cache rows" in k.reasons()["latent_to_cache"]["triton"]
        assert k.names()["rms_norm"] == "triton"  # (the families that can take it keep it)


def test_selections_are_independent_objects():
    """No kernel state outside a selection: one model's torch kernels and another's defaults
    side by side, each as chosen."""
    cfg = _cfg()
    ref, auto = (
        select_kernels("cpu", torch.float32, cfg, allow="torch"),
        select_kernels("cpu", torch.float32, cfg),
    )
    assert set(ref.names().values()) == {"torch", "unfused"}
    assert ref.reasons()["mla_decode"]["cpp"].startswith("not among the kernels asked for")
    assert auto.names()["mla_decode"] == ("cpp" if CPP else "torch")
    assert ref.rms_norm is not auto.rms_norm or not CPP
    with pytest.raises(ValueError, match="unknown implementation"):
        select_kernels("cpu", torch.float32, cfg, allow="cuda-magic,torch")


def test_the_engine_logs_its_kernels_at_startup_and_shows_them_in_its_stats(tiny_model, caplog):
    from services.engine.engine import EngineConfig, LocalEngine

    with caplog.at_level(logging.INFO, logger="services.engine.engine"):
        engine = LocalEngine(EngineConfig(model=str(tiny_model), max_num_seqs=2))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels on cpu float32: ")]
    assert len(lines) == 1 and all(f"{f}={n}" in lines[0] for f, n in engine.kernels.names().items())
    stats = engine.stats()
    assert stats["kernels"] == engine.kernels.names() and stats["kernel_reasons"] == engine.kernels.reasons()
    assert engine.model.kernels is engine.kernels and engine.experts.kernels is engine.kernels  # (once)
    assert stats["kernels"]["mla_decode"] == ("cpp" if CPP else "torch")
    # an implementation asked for by name that runs nothing here: refused before loading anything
    with pytest.raises(ValueError, match="flashmla runs no kernel family here"):
        LocalEngine(EngineConfig(model=str(tiny_model), kernels="flashmla,torch"))


def test_the_expert_store_chooses_its_expert_kernel_once_and_shows_it(tiny_model):
    from services.experts.store import SlotStore

    cfg = ModelConfig.from_dir(tiny_model)
    stats = SlotStore(cfg, tiny_model, torch.float32).stats()
    assert set(stats.kernels) == {"linear", "expert_ffn", "expert_dispatch"}
    assert stats.kernels["expert_dispatch"] == ("cpp" if CPP else "torch")
    assert stats.kernel_reasons["expert_ffn"].get("triton", "").startswith("CPU tensors")
    held_fp8 = select_kernels("cpu", torch.float32, cfg, fp8_experts=True, scope="experts")
    assert held_fp8.names()["expert_dispatch"] == "torch"
    if CPP:
        assert "kept FP8" in held_fp8.reasons()["expert_dispatch"]["cpp"]
