"""vLLM's `vllm serve` spellings for `moe-cluster serve`: the flags (each under dest vllm_<name>),
their value parsers and the mapping's bookkeeping (`FlagMapping`: settings set, notes on flags
accepted without effect). A flag with an equivalent sets it, one that means nothing here is
accepted with a logged note, one that cannot be honoured is refused by name. docs/vllm.md has the
table; cli.py's `serve_config` applies it."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

REVISION_HELP = "of a Hugging Face --model: a branch, tag or commit (default: main)"


VLLM_KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_ds_mla": "fp8"}
VLLM_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
                "float32": "float32"}  # fmt: skip
TOOL_CALL_PARSERS = ("deepseek_v3", "deepseek_v31")  # the markups services/router/chat_format.py parses
REASONING_PARSERS = ("deepseek_r1", "deepseek_v3")  # `<think>` ... `</think>`
MTP_METHODS = (None, "mtp", "deepseek_mtp")
# what a generation config may set that vLLM's `--generation-config auto` makes the default of requests
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def vllm_len(text: str) -> int:
    """vLLM's human-readable lengths: 4096, 32k (32,000), 32K (32,768), 25.6k."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    if m is None or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"a length, like 4096, 32k or 32K; got {text!r}")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]
    return int(float(m.group(1)) * scale)


def add_vllm_flags(s: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """vLLM's flags on `serve`, each under dest vllm_<name> (docs/vllm.md: what each does here)."""
    g = s.add_argument_group("vLLM's flags (docs/vllm.md: what each maps to here)")
    add = g.add_argument
    add("--model", dest="vllm_model", metavar="MODEL", help="the model, as the positional MODEL")
    add("--revision", metavar="REV", help=REVISION_HELP)
    add(
        "--download-dir",
        dest="download_dir",
        metavar="DIR",
        help="Hugging Face cache directory (default: HF_HOME's)",
    )
    add(
        "--tensor-parallel-size",
        "-tp",
        dest="vllm_tensor_parallel_size",
        type=int,
        metavar="N",
        help="-> --attention-tp",
    )
    add(
        "--data-parallel-size",
        "-dp",
        dest="vllm_data_parallel_size",
        type=int,
        metavar="N",
        help="-> --attention-workers",
    )
    add("--enable-expert-parallel", "-ep", dest="vllm_enable_expert_parallel", action="store_true",
        help="always: routed experts live in the expert workers (--expert-workers)")  # fmt: skip
    add("--max-model-len", dest="vllm_max_model_len", type=vllm_len, metavar="LEN", help="-> --max-model-len")
    add(
        "--kv-cache-dtype",
        dest="vllm_kv_cache_dtype",
        metavar="DTYPE",
        help="auto, fp8 (fp8_e4m3, fp8_ds_mla) -> --kv-cache-dtype",
    )
    add("--gpu-memory-utilization", dest="vllm_gpu_memory_utilization", type=float, metavar="F",
        help="accepted: the KV cache is --kv-cache-gib, a worker's GPU memory its share (--attention-gpus)")  # fmt: skip
    add("--served-model-name", dest="vllm_served_model_name", nargs="+", metavar="NAME",
        help="-> --served-model-name (the first: the router serves one name)")  # fmt: skip
    add("--api-key", dest="vllm_api_key", metavar="KEY", help="-> --api-key (env VLLM_API_KEY too)")
    add("--enable-auto-tool-choice", dest="vllm_enable_auto_tool_choice", action="store_true",
        help="always on: tool_choice auto")  # fmt: skip
    add(
        "--tool-call-parser",
        dest="vllm_tool_call_parser",
        metavar="NAME",
        help=f"{', '.join(TOOL_CALL_PARSERS)}: always on",
    )
    add(
        "--reasoning-parser",
        dest="vllm_reasoning_parser",
        metavar="NAME",
        help=f"{', '.join(REASONING_PARSERS)}: always on",
    )
    add("--speculative-config", dest="vllm_speculative_config", metavar="JSON",
        help='{"method": "mtp", "num_speculative_tokens": N} -> --speculative-tokens N')  # fmt: skip
    add("--enable-eplb", dest="vllm_enable_eplb", action="store_true",
        help="always on: the balancer re-places experts every --balancer-period-s")  # fmt: skip
    add(
        "--num-redundant-experts",
        dest="vllm_num_redundant_experts",
        type=int,
        metavar="N",
        help="-> --redundant-experts",
    )
    add("--trust-remote-code", dest="vllm_trust_remote_code", action="store_true",
        help="accepted: no remote code runs here (the DeepSeek architectures are built in)")  # fmt: skip
    add("--port", dest="vllm_port", type=int, metavar="PORT", help="-> --port (default 8000)")
    add(
        "--host",
        dest="vllm_host",
        metavar="HOST",
        help="-> --host (default 127.0.0.1; vLLM's: every interface)",
    )
    add(
        "--chat-template",
        dest="vllm_chat_template",
        metavar="TEMPLATE",
        help="-> --chat-template: a Jinja chat template or its file, in place of the checkpoint's",
    )
    add("--generation-config", dest="vllm_generation_config", metavar="auto|vllm|DIR",
        help="vllm: accepted; auto or a folder: accepted where it sets no sampling default")  # fmt: skip
    add("--enforce-eager", dest="vllm_enforce_eager", action="store_true",
        help="accepted on CPU (no CUDA graphs there); refused with GPU workers")  # fmt: skip
    add(
        "--dtype",
        dest="vllm_dtype",
        metavar="DTYPE",
        help="auto, bfloat16, float16 (half), float32 (float) -> --dtype",
    )
    add("--seed", dest="vllm_seed", type=int, metavar="N", help="refused: give `seed` per request")
    add("--max-num-seqs", dest="vllm_max_num_seqs", type=int, metavar="N", help="-> --max-num-seqs")
    add("--enable-prefix-caching", dest="vllm_enable_prefix_caching", action=argparse.BooleanOptionalAction,
        default=None, help="-> --prefix-caching / --no-prefix-caching")  # fmt: skip
    return g


class FlagMapping:
    """The flat settings vLLM's flags map to, checked against our own flags given alongside."""

    def __init__(self, ours: dict):
        self.ours, self.settings, self.notes = ours, {}, []

    def put(self, key: str, value, flag: str) -> None:
        if key in self.ours and self.ours[key] != value:
            raise ValueError(f"{flag} ({value}) and --{key.replace('_', '-')} ({self.ours[key]}) disagree")
        self.settings[key] = value

    def note(self, flag: str, text: str) -> None:
        self.notes.append(f"{flag}: {text}")


def refuse(flag: str, why: str) -> None:
    raise ValueError(f"{flag}: {why} (docs/vllm.md)")


def speculative(text: str, model: str | None, m: FlagMapping, settings: dict) -> None:
    """vLLM's --speculative-config JSON -> speculative_tokens (the checkpoint's MTP module drafts)
    and its disable_by_batch_size -> speculative_disable_by_batch_size."""
    flag = "--speculative-config"
    if "speculative_tokens" not in settings:
        refuse(flag, "speculative decoding is not available in this version (no --speculative-tokens)")
    from services.engine.speculative import parse_speculative_config

    try:
        spec = json.loads(text)
        if not isinstance(spec, dict):
            raise ValueError('a JSON object, like {"method": "mtp", "num_speculative_tokens": 1}')
        if spec.get("model") not in (None, model):
            raise ValueError(f"a draft model ({spec['model']}): only the checkpoint's own MTP module drafts")
        n = parse_speculative_config(spec)
    except ValueError as e:  # (json.JSONDecodeError too)
        refuse(flag, str(e))
    ignored = sorted(set(spec) - {"method", "model", "num_speculative_tokens", "disable_by_batch_size"})
    if ignored:
        m.note(flag, f"ignored: {', '.join(ignored)}")
    m.put("speculative_tokens", n, flag)
    if spec.get("disable_by_batch_size") is not None and "speculative_disable_by_batch_size" in settings:
        m.put("speculative_disable_by_batch_size", spec["disable_by_batch_size"], flag)


def generation_config(value: str, model_dir: str | None, m: FlagMapping) -> None:
    """vLLM's --generation-config: `vllm` (no defaults from the model: what this server does) is
    accepted; `auto` (the model's) or a folder only where the file sets no sampling default,
    since requests here default to the API's own values."""
    flag = "--generation-config"
    if value == "vllm":
        m.note(flag, "vllm: requests default to the OpenAI API's sampling values, as here always")
        return
    folder = Path(model_dir) if value == "auto" and model_dir else Path(value)
    path = folder / "generation_config.json"
    found = json.loads(path.read_text()) if path.is_file() else {}
    sets = {k: found[k] for k in SAMPLING_DEFAULTS if found.get(k) is not None}
    if sets:
        given = ", ".join(f"{k}={val}" for k, val in sets.items())
        refuse(flag, f"{value}: {path} sets sampling defaults ({given}) that this server does not apply; give "
                "them in the requests, or pass --generation-config vllm")  # fmt: skip
    m.note(flag, f"{value}: {path if path.is_file() else 'no generation config'} sets no sampling default")
