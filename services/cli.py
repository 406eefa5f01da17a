"""The `moe-cluster` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from services.settings import NAMESPACE
from services.vllm_flags import (
    REASONING_PARSERS,
    REVISION_HELP,
    TOOL_CALL_PARSERS,
    VLLM_DTYPES,
    VLLM_KV_CACHE_DTYPES,
    FlagMapping,
    add_vllm_flags,
    generation_config,
    refuse,
    speculative,
)

log = logging.getLogger("moe_cluster.cli")
MODEL_HELP = (
    "checkpoint directory, or a Hugging Face id (org/name, see --revision) resolved through the Hugging "
    "Face cache (HF_HOME, HF_HUB_OFFLINE, HF_TOKEN) and downloaded if missing (default: the tiny preset)"
)


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-token-ids wants comma-separated integers, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-token-ids is empty")
    return ids


def cmd_init_model(args) -> int:
    from services.presets import init_model

    path = init_model(args.dir, args.preset, seed=args.seed, fp8=args.fp8, dtype=args.dtype, device=args.device,
                      mtp=args.mtp)  # fmt: skip
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0


def cmd_generate(args) -> int:
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams
    from services.engine.scheduler import RequestError
    from services.engine.speculative import speculative_disable_by_batch_size, speculative_tokens
    from services.hf_models import ModelNotFound, resolve_model
    from services.presets import default_model_dir

    try:
        model = resolve_model(args.model, args.revision).path if args.model else default_model_dir()
    except ModelNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = LocalEngine(
        EngineConfig(
            model=str(model),
            dtype=args.dtype,
            weight_dtype=args.weight_dtype,
            keep_fp8_experts=args.keep_fp8_experts,
            keep_fp8_linears=args.keep_fp8_linears,
            num_threads=args.threads,
            deterministic=args.deterministic,
            speculative_tokens=speculative_tokens(args.speculative_tokens, args.speculative_config),
            speculative_disable_by_batch_size=speculative_disable_by_batch_size(
                args.speculative_disable_by_batch_size, args.speculative_config
            ),
        )
    )
    prompts: list[list[int]] = list(args.prompt_token_ids or [])
    text_mode = bool(args.prompt)
    if text_mode:
        if engine.tokenizer is None:
            print("error: this checkpoint has no tokenizer; pass --prompt-token-ids", file=sys.stderr)
            return 2
        prompts += [engine.tokenizer.encode(p) for p in args.prompt]
    if not prompts:
        print("error: give --prompt-token-ids or --prompt", file=sys.stderr)
        return 2
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        results = engine.generate(prompts, params)
    except (RequestError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in results:
        if args.json:
            text = r.text if text_mode else ""
            print(json.dumps({"token_ids": r.token_ids, "text": text, "finish_reason": r.finish_reason}))
        else:
            print(r.text if text_mode else " ".join(map(str, r.token_ids)))
    return 0


def cmd_up(args) -> int:
    try:
        cfg = up_config(args)
    except (ValueError, OSError) as e:  # (hf_models.ModelNotFound is a ValueError)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_cluster(cfg)


def up_config(args, overrides: dict | None = None):
    """The ClusterConfig of `moe-cluster up`'s (or `serve`'s) arguments: the YAML file's settings
    with the flags (`overrides`: flat keys; default: every setting flag given) over them, the
    model resolved to a local directory (a Hugging Face id through its cache), the secrets the
    environment holds."""
    from services.cluster import ClusterConfig

    if overrides is None:
        overrides = {k: getattr(args, k) for k in up_flags() if getattr(args, k, None) is not None}
    if args.config:
        cfg = ClusterConfig.from_yaml(args.config, **overrides)
    else:
        cfg = ClusterConfig.from_dict(overrides)
    cfg = with_local_model(cfg, args.revision, getattr(args, "download_dir", None))
    return secrets_from_env(cfg)


def with_local_model(cfg, revision: str | None = None, cache_dir: str | None = None):
    """`cfg` with its model resolved once, here, to a local directory (services/hf_models.py), so
    that every service is handed a path; a Hugging Face id is also the model's default name in the
    API (vLLM's), not the snapshot directory's commit hash."""
    from services.hf_models import resolve_model

    if not cfg.model:
        return cfg
    resolved = resolve_model(cfg.model, revision, cache_dir=cache_dir)
    changes = {"model": resolved.path}
    if resolved.repo_id and not cfg.router.served_model_name:
        changes["served_model_name"] = resolved.repo_id
    return dataclasses.replace(cfg, **changes)


def run_cluster(cfg) -> int:
    """Start the cluster of `cfg` and serve until Ctrl-C (or SIGTERM)."""
    import signal
    import time

    from tqdm import tqdm

    from services.cluster import Cluster

    bar = tqdm(total=5, desc="moe-cluster up", unit="step", file=sys.stderr)

    def progress(msg: str) -> None:
        bar.set_postfix_str(msg)
        bar.update(1)

    try:
        cluster = Cluster.start(cfg, progress)
    except KeyboardInterrupt:
        bar.close()
        print("\ninterrupted while starting; stopped what had started", file=sys.stderr)
        return 130
    except ValueError as e:  # a setting the cluster cannot meet (e.g. GPUs it does not have)
        bar.close()
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    bar.close()
    print(f"\nmoe-cluster is up: {cluster.url}  (model {cluster.model_dir})")
    print("try:")
    name = (cfg.router.served_model_name or Path(cluster.model_dir).name).split(",")[0]
    print(
        f"  curl {cluster.url}/v1/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{name}", "prompt": "Hello", "max_tokens": 16}}\''
    )
    print("Ctrl-C stops everything.", flush=True)
    # Ray replaces the default SIGINT handling. The handler only appends to a list: a handler that
    # took a lock (Event.set) could interrupt the main thread holding it and hang there for good
    # (seen: two Ctrl-Cs left `up` hanging in Event.set)
    signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _: signals.append(signum))
    try:
        while not signals:
            time.sleep(0.2)  # (a signal ends the sleep; its handler runs in between)
    except KeyboardInterrupt:
        pass
    print("shutting down ...", file=sys.stderr)
    cluster.stop()
    return 0


def cmd_status(args) -> int:
    import ray

    from services.cluster import connect

    balancer = connect(args.address, args.namespace)
    st = ray.get(balancer.status.remote())
    if args.json:
        print(json.dumps({k: v for k, v in st.items() if k not in ("phy2log", "loads")}, indent=2))
        return 0
    b = st["balancedness"]
    print(
        f"placement version {st['version']}   balancedness {'-' if b is None else f'{b:.3f}'}   "
        f"migrations {st['migrations']}   heals {st['heals']}   slots/worker {st['slots_per_worker']}"
    )
    attention = []
    for name, a in st["attention"].items():
        if "tp" in a:
            attention.append(f"{name} (ranks {a['tp']}, v{a['placement_version']})")
        else:
            attention.append(f"{name} ({a.get('state', 'starting')})")
    print(f"attention workers: {', '.join(attention) or '-'}")
    for name, stats in _attention_stats(list(st["attention"]), args.namespace).items():
        transports = (stats.get("dispatch") or {}).get("transport", {})
        pairs = ", ".join(f"{w} {t}" for w, t in sorted(transports.items()))
        wait_ms = 1e3 * stats.get("expert_wait_per_moe_layer_s", 0.0)
        print(f"  {name} -> experts: {pairs or '-'}; expert wait {wait_ms:.2f} ms per MoE layer and step")
        by_address = {w["address"]: w["id"] for w in st["workers"]}
        for e in (stats.get("dispatch") or {}).get("transport_events", [])[-3:]:  # (the latest choices)
            when = time.strftime("%H:%M:%S", time.localtime(e["at"]))
            worker = by_address.get(e["worker"], e["worker"])
            print(f"    {when} {worker}: {e['transport'] or 'no transport'} ({e['reason'][:100]})")
        if "kv_cache_tokens" in stats:
            print(f"  {name} KV cache: {stats['kv_cache_tokens']} tokens ({stats['kv_cache_dtype']} rows), "
                  f"{stats['kv_blocks_used']} of {stats['kv_blocks_total']} blocks in use")  # fmt: skip
        spec = stats.get("spec_decode")  # (speculating: the drafted tokens accepted, vLLM's counters)
        if spec:
            rate = "-" if spec["acceptance_rate"] is None else f"{spec['acceptance_rate']:.2f}"
            print(f"  {name} speculative decoding: {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} drafted "
                  f"tokens accepted (rate {rate}) in {spec['num_drafts']} drafts; "
                  f"{spec.get('by_batch_size_summary', '-')}")  # fmt: skip
    print(f"{'expert worker':16} {'state':9} {'address':22} {'node':14} {'slots':>6} {'load':>10}")
    for w in st["workers"]:
        load = "-" if w.get("load") is None else f"{w['load']:.0f}"
        print(
            f"{w['id']:16} {w['state']:9} {w['address']:22} {w['node'][:12]:14} {len(w['slots']):>6} {load:>10}"
        )
    for d in st["dead_workers"][-5:]:
        healed = "not yet" if d["healed_s"] is None else f"in {d['healed_s']:.1f}s"
        print(f"{d['worker_id']:16} {'dead':9} {d['address']:22} {d['reason'][:40]}; healed {healed}")
    return 0


def _attention_stats(attention: list[str], namespace: str) -> dict[str, dict]:
    """Each attention worker's stats (its data plane to each expert worker, its expert wait);
    workers that do not answer within 5 s are left out."""
    import ray

    out = {}
    for name in attention:
        try:
            out[name] = ray.get(ray.get_actor(name, namespace=namespace).stats.remote(), timeout=5)
        except Exception:  # noqa: BLE001 (a worker restarting or gone: nothing to show for it)
            continue
    return out


def cmd_scale_experts(args) -> int:
    import ray

    from services.cluster import connect

    balancer = connect(args.address, args.namespace)
    result = ray.get(
        balancer.scale_experts.remote(None if args.num_workers == "auto" else int(args.num_workers))
    )
    print(json.dumps(result, indent=2))
    return 0 if result.get("ok", True) else 1


def cmd_bench(args) -> int:
    import runpy

    names = {"local-engine": "benchmarks.bench_local_engine", "eplb": "benchmarks.bench_eplb",
             "dispatch": "benchmarks.bench_dispatch", "attention": "benchmarks.bench_attention",
             "balancer": "benchmarks.bench_balancer", "faults": "benchmarks.bench_faults",
             "prefix": "benchmarks.bench_prefix", "grammar": "benchmarks.bench_grammar",
             "long-context": "benchmarks.bench_long_context", "fp8-cache": "benchmarks.bench_fp8_cache",
             "grpc-streams": "benchmarks.bench_grpc_streams", "kernels": "benchmarks.bench_kernels",
             "replan-memory": "benchmarks.bench_replan_memory", "mla-prefill": "benchmarks.bench_mla_prefill"}  # fmt: skip
    if args.which == "all":  # (the Triton kernels' and the MLA prefill benchmarks need a GPU)
        import torch

        chosen = [n for n in names if n not in ("kernels", "mla-prefill") or torch.cuda.is_available()]
    else:
        chosen = [args.which]
    for name in chosen:
        print(f"== {name}", flush=True)
        sys.argv = [names[name], *args.rest]
        runpy.run_module(names[name], run_name="__main__")
    return 0


def secrets_from_env(cfg, environ=os.environ):
    """`cfg` with the secrets neither a flag nor the YAML file gave taken from the environment
    (MOE_API_KEY, MOE_EXPERT_SECRET, MOE_REDIS_URL: services/serve.py's), so that none has to be
    on a command line, where `ps` shows it."""
    import dataclasses

    from services.serve import SECRET_ENV

    found = {
        key: environ[env] for key, env in SECRET_ENV.items() if environ.get(env) and not getattr(cfg, key)
    }
    if not found:
        return cfg
    cfg = dataclasses.replace(cfg, **found)
    cfg.validate()
    return cfg


# ---- `moe-cluster serve MODEL [vLLM flags]`: the flags themselves in vllm_flags.py --------------


def vllm_flags(parser: argparse.ArgumentParser | None = None) -> list[str]:
    """The vLLM flags `moe-cluster serve` takes (their long spellings)."""
    parser = parser or build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    (group,) = [g for g in serve._action_groups if g.title.startswith("vLLM")]
    return [next(o for o in a.option_strings if o.startswith("--")) for a in group._group_actions]


def serve_config(args, environ=os.environ):
    """`moe-cluster serve`'s ClusterConfig and the notes on the vLLM flags accepted without
    effect: vLLM's flags mapped to our settings (alongside any of our own flags, and over a
    --config file), the model resolved. ValueError names a flag that cannot be honoured."""
    from services.cluster import ClusterConfig

    ours = {k: getattr(args, k) for k in up_flags() if getattr(args, k, None) is not None}
    m, v = FlagMapping(ours), args
    if v.model_tag and v.vllm_model and v.model_tag != v.vllm_model:
        raise ValueError(f"two models: {v.model_tag} and --model {v.vllm_model}")
    model = v.model_tag or v.vllm_model
    if model:
        m.put("model", model, "MODEL")
    if v.vllm_tensor_parallel_size is not None:
        m.put("attention_tp", v.vllm_tensor_parallel_size, "--tensor-parallel-size")
    if v.vllm_data_parallel_size is not None:
        m.put("attention_workers", v.vllm_data_parallel_size, "--data-parallel-size")
    if v.vllm_enable_expert_parallel:
        m.note("--enable-expert-parallel", "always: the routed experts are served by the expert workers "
               "(--expert-workers), apart from attention's TP and DP")  # fmt: skip
    if v.vllm_max_model_len is not None:
        m.put("max_model_len", v.vllm_max_model_len, "--max-model-len")
    if v.vllm_kv_cache_dtype is not None:
        if v.vllm_kv_cache_dtype not in VLLM_KV_CACHE_DTYPES:
            refuse("--kv-cache-dtype", f"{v.vllm_kv_cache_dtype!r}: the latent cache holds auto (the model dtype) "
                    f"or fp8 rows (FlashMLA's e4m3 layout): {', '.join(VLLM_KV_CACHE_DTYPES)}")  # fmt: skip
        m.put("kv_cache_dtype", VLLM_KV_CACHE_DTYPES[v.vllm_kv_cache_dtype], "--kv-cache-dtype")
    if v.vllm_gpu_memory_utilization is not None:
        if not 0 < v.vllm_gpu_memory_utilization <= 1:
            refuse("--gpu-memory-utilization", f"{v.vllm_gpu_memory_utilization} not in (0, 1]")
        m.note("--gpu-memory-utilization", "not used: the KV cache takes --kv-cache-gib per attention worker, and a "
               "worker on part of a GPU is held to its share (--attention-gpus, --expert-gpus)")  # fmt: skip
    if v.vllm_served_model_name:  # (all answered; the first is the API's own name)
        m.put("served_model_name", ",".join(v.vllm_served_model_name), "--served-model-name")
    if v.vllm_api_key is not None:
        m.put("api_key", v.vllm_api_key, "--api-key")
    if v.vllm_enable_auto_tool_choice:
        m.note("--enable-auto-tool-choice", "always on: requests with tools may use tool_choice auto")
    if v.vllm_tool_call_parser is not None:
        if v.vllm_tool_call_parser not in TOOL_CALL_PARSERS:
            refuse("--tool-call-parser", f"{v.vllm_tool_call_parser!r}: DeepSeek's tool-call markup is parsed "
                    f"({', '.join(TOOL_CALL_PARSERS)})")  # fmt: skip
        m.note(
            "--tool-call-parser", "always on: DeepSeek-V3 and V3.1 tool-call markup is parsed into tool_calls"
        )
    if v.vllm_reasoning_parser is not None:
        if v.vllm_reasoning_parser not in REASONING_PARSERS:
            refuse("--reasoning-parser", f"{v.vllm_reasoning_parser!r}: DeepSeek's <think> reasoning is parsed "
                    f"({', '.join(REASONING_PARSERS)})")  # fmt: skip
        m.note("--reasoning-parser", "always on: <think> reasoning is returned as reasoning_content")
    if v.vllm_speculative_config is not None:
        speculative(v.vllm_speculative_config, model, m, ClusterConfig.settings())
    if v.vllm_enable_eplb:
        m.note("--enable-eplb", "always on: the balancer re-places experts by their measured load every "
               "--balancer-period-s (default 30 s)")  # fmt: skip
    if v.vllm_num_redundant_experts is not None:
        m.put("redundant_experts", v.vllm_num_redundant_experts, "--num-redundant-experts")
    if v.vllm_trust_remote_code:
        m.note("--trust-remote-code", "no remote code runs here: the DeepSeek architectures are built in")
    if v.vllm_port is not None:
        m.put("port", v.vllm_port, "--port")
    if v.vllm_host is not None:
        m.put("host", v.vllm_host, "--host")
    if v.vllm_chat_template is not None:  # (a file is read here: the router may run on another node)
        from services.engine.tokenizer import read_template

        try:
            m.put("chat_template", read_template(v.vllm_chat_template), "--chat-template")
        except (ValueError, OSError) as e:
            refuse("--chat-template", str(e))
    if v.vllm_dtype is not None:
        if v.vllm_dtype == "auto":
            m.note("--dtype", "auto: the dtype setting stays as it is (default float32)")
        elif v.vllm_dtype in VLLM_DTYPES:
            m.put("dtype", VLLM_DTYPES[v.vllm_dtype], "--dtype")
        else:
            refuse("--dtype", f"{v.vllm_dtype!r}: auto, {', '.join(VLLM_DTYPES)}")
    if v.vllm_seed is not None:
        refuse("--seed", "there is no engine-wide seed here: a request samples from its own `seed` (or a fresh "
                "one), so give `seed` in the requests that must repeat")  # fmt: skip
    if v.vllm_max_num_seqs is not None:
        m.put("max_num_seqs", v.vllm_max_num_seqs, "--max-num-seqs")
    if v.vllm_enable_prefix_caching is not None:
        m.put("prefix_caching", v.vllm_enable_prefix_caching, "--enable-prefix-caching")

    try:
        cfg = up_config(args, {**ours, **m.settings})
    except ValueError as e:  # (a setting a vLLM flag gave, refused by its section: name the flag)
        flag = {"speculative_tokens": "--speculative-config"}.get(str(e).split(":")[0])
        if flag and str(e).split(":")[0] in m.settings:
            raise ValueError(f"{flag}: {e}") from None
        raise
    if v.vllm_enforce_eager:
        if cfg.attention.gpus > 0:
            refuse("--enforce-eager", "GPU attention workers replay decode steps from CUDA graphs, which no "
                    "setting turns off yet")  # fmt: skip
        m.note("--enforce-eager", "nothing to do: no CUDA graphs on CPU workers")
    if v.vllm_generation_config is not None:
        generation_config(v.vllm_generation_config, cfg.model, m)
    if not cfg.router.api_key and environ.get("VLLM_API_KEY"):
        cfg = dataclasses.replace(cfg, api_key=environ["VLLM_API_KEY"])
    return cfg, m.notes


def cmd_serve(args) -> int:
    try:
        cfg, notes = serve_config(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        log.warning("%s", note)
    return run_cluster(cfg)


def up_flags() -> dict[str, tuple[type, str]]:
    """`moe-cluster up` flags: every scalar setting of ClusterConfig (services/settings.py), as
    (type, help) by flat key (dict settings are YAML-only)."""
    return {key: (kind, help_) for key, (kind, help_, _) in _up_settings().items()}


def _up_settings() -> dict[str, tuple[type, str, str | None]]:
    """The scalar settings: flat key -> (type, help, section)."""
    from types import UnionType
    from typing import get_args, get_origin, get_type_hints

    from services.cluster import ClusterConfig

    flags = {}
    for key, s in ClusterConfig.settings().items():
        hint = get_type_hints(s.owner)[s.name]
        kinds = (
            [t for t in get_args(hint) if t is not type(None)] if get_origin(hint) is UnionType else [hint]
        )
        if len(kinds) == 1 and kinds[0] in (bool, int, float, str):
            flags[key] = (kinds[0], s.help, s.section)
    return flags


def _add_setting_flags(s: argparse.ArgumentParser, skip: set[str] = frozenset()) -> None:
    """A flag per scalar cluster setting (services/settings.py), grouped by service; `skip`: the
    spellings taken by other flags (`serve`'s vLLM ones)."""
    groups = {}  # section -> its flags' group: --help lists them by service
    for name, (kind, help_, section) in _up_settings().items():
        flag = f"--{name.replace('_', '-')}"
        if flag in skip:
            continue
        if section not in groups:
            groups[section] = s.add_argument_group(f"{section or 'cluster'} settings")
        add, help_ = groups[section].add_argument, MODEL_HELP if name == "model" else help_
        if kind is bool:  # --prefix-caching / --no-prefix-caching
            add(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            add(flag, type=kind, help=help_)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-cluster", description=__doc__)
    p.add_argument("--log-level", default=os.environ.get("MOE_CLUSTER_LOG", "WARNING"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("init-model", help="write a random-weight DeepSeek-V3 (V3.2, V4) checkpoint")
    s.add_argument("dir")
    s.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "tiny-v32", "tiny-v4", "small", "medium"],
        help="tiny: DeepSeek-V3 dims for tests; tiny-v32: with V3.2's indexer; tiny-v4: DeepSeek-V4 "
        "(every layer type); small: ~84M parameters; medium: DeepSeek-V2-Lite's shape, ~16B "
        "parameters (31 GB in bf16: with --dtype bfloat16 --device cuda) (default: tiny)",
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--fp8", action="store_true", help="FP8 e4m3 128x128 block-quantised weights")
    s.add_argument("--dtype", default="float32", help="of the weights written (bfloat16 halves them)")
    s.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: seconds for medium)")
    s.add_argument("--mtp", action="store_true",
                   help="with a multi-token-prediction module (num_nextn_predict_layers 1): a drafter")  # fmt: skip
    s.set_defaults(fn=cmd_init_model)

    s = sub.add_parser("generate", help="run prompts through the single-process LocalEngine")
    s.add_argument("--model", help=MODEL_HELP)
    s.add_argument("--revision", help=REVISION_HELP)
    s.add_argument("--prompt-token-ids", type=_token_ids, action="append", metavar="1,2,3")
    s.add_argument("--prompt", action="append", metavar="TEXT")
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--weight-dtype", default=None, help="bfloat16: weights in bf16 under float32 (CPU)")
    s.add_argument(
        "--keep-fp8-experts", action="store_true", help="FP8 checkpoints: routed experts held in FP8"
    )
    s.add_argument("--keep-fp8-linears", action="store_true", help="FP8 checkpoints: linears held in FP8")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: each prompt's tokens as if it ran alone (CPU)")  # fmt: skip
    s.add_argument("--speculative-tokens", type=int, default=None, metavar="N",
                   help="speculative decoding: N tokens drafted per step by the checkpoint's MTP module (default 0)")  # fmt: skip
    s.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                   help="no speculation in a step with more than N sequences running (default 0: auto, measured)")  # fmt: skip
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's form of it: '{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1}'")  # fmt: skip
    s.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("up", help="start the cluster: Ray, Redis, workers, balancer, OpenAI API")
    s.add_argument("--config", help="YAML file with cluster settings (flags override it)")
    s.add_argument("--revision", help=REVISION_HELP)
    _add_setting_flags(s)
    s.set_defaults(fn=cmd_up)

    s = sub.add_parser(
        "serve",
        help="`up` with vLLM's command line: moe-cluster serve MODEL [vLLM flags] [our flags] (docs/vllm.md)",
    )
    s.add_argument("model_tag", nargs="?", metavar="MODEL", help=MODEL_HELP)
    s.add_argument("--config", help="YAML file with cluster settings (flags override it)")
    vllm = add_vllm_flags(s)
    _add_setting_flags(s, skip={o for a in vllm._group_actions for o in a.option_strings})
    s.set_defaults(fn=cmd_serve)

    for name, fn, help_ in (("status", cmd_status, "placement, expert workers, loads, balancedness"),
                            ("scale-experts", cmd_scale_experts, "grow or shrink the expert pool")):  # fmt: skip
        s = sub.add_parser(name, help=help_)
        if name == "scale-experts":
            s.add_argument(
                "num_workers", help='N (pins the pool at N) or "auto" (hands it back to the autoscaler)'
            )
        s.add_argument("--address", default="auto")
        s.add_argument("--namespace", default=NAMESPACE)
        s.add_argument("--json", action="store_true")
        s.set_defaults(fn=fn)

    s = sub.add_parser("bench", help="run benchmarks (JSON results under benchmarks/results/)")
    s.add_argument("which", choices=["all", "local-engine", "eplb", "dispatch", "attention", "balancer", "faults",
                                     "prefix", "grammar", "long-context", "fp8-cache", "grpc-streams", "kernels",
                                     "replan-memory", "mla-prefill"])  # fmt: skip
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
