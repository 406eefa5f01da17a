"""`moe-cluster serve MODEL [vLLM flags]`: a vLLM command line parsed into the cluster's settings
(no cluster started), the model given as a Hugging Face id resolved offline at a pinned revision;
flags that mean nothing here accepted with a note, flags that cannot be honoured refused by name;
docs/vllm.md's table names every vLLM flag `serve` takes."""

import re
import shlex
from pathlib import Path

import pytest

from services.cli import build_parser, main, serve_config, vllm_flags
from services.cluster import ClusterConfig

from .hub_cache import add_snapshot, commit_hash

REPO = "deepseek-ai/DeepSeek-V3-tiny"
COMMIT = commit_hash("pinned")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"
HAS_SPECULATIVE = "speculative_tokens" in ClusterConfig.settings()

VLLM_COMMAND = (
    f"serve {REPO} --revision {COMMIT} --tensor-parallel-size 2 --data-parallel-size 2 --enable-expert-parallel "
    "--max-model-len 2k --kv-cache-dtype fp8_e4m3 --gpu-memory-utilization 0.9 --served-model-name deepseek-v3 ds3 "
    "--api-key sk-local --enable-auto-tool-choice --tool-call-parser deepseek_v3 --reasoning-parser deepseek_r1 "
    "--enable-eplb --num-redundant-experts 4 --trust-remote-code --port 9100 --host 0.0.0.0 "
    "--generation-config vllm --enforce-eager --dtype bfloat16 --max-num-seqs 32 --no-enable-prefix-caching "
    "--expert-workers 3"  # (and one of our own flags beside them)
)


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_model):
    """An offline Hugging Face cache holding the tiny preset as REPO at COMMIT."""
    snapshot = add_snapshot(tmp_path / "hub", REPO, tiny_model, COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for env in ("VLLM_API_KEY", "MOE_API_KEY", "MOE_EXPERT_SECRET", "MOE_REDIS_URL"):
        monkeypatch.delenv(env, raising=False)
    return snapshot


def _serve(command: str, environ=None, extra: list[str] = ()):
    args = build_parser().parse_args([*shlex.split(command), *extra])
    return serve_config(args, environ if environ is not None else {})


def test_a_vllm_command_line_maps_to_the_cluster_settings(hub):
    cfg, notes = _serve(VLLM_COMMAND)
    print("\n".join(notes))
    a, e, r = cfg.attention, cfg.experts, cfg.router
    assert cfg.model == str(hub)  # the id, resolved offline at the pinned commit
    assert (a.tp, a.workers, a.max_model_len, a.kv_cache_dtype, a.max_num_seqs, a.prefix_caching) == (
        2, 2, 2000, "fp8", 32, False
    )  # fmt: skip
    assert (e.workers, e.redundant_experts, cfg.shared.dtype) == (3, 4, "bfloat16")
    assert (r.served_model_name, r.api_key, r.port, r.host) == (
        "deepseek-v3,ds3",
        "sk-local",
        9100,
        "0.0.0.0",
    )
    noted = {n.split(":")[0] for n in notes}
    assert noted == {
        "--enable-expert-parallel", "--gpu-memory-utilization", "--enable-auto-tool-choice",
        "--tool-call-parser", "--reasoning-parser", "--enable-eplb", "--trust-remote-code", "--generation-config",
        "--enforce-eager",
    }  # fmt: skip
    # the rest at our defaults, as `up` would have them
    assert (a.kv_cache_gib, e.keep_fp8_experts, cfg.balancer.period_s) == (2.0, False, 30.0)


def test_the_model_defaults_to_its_id_and_the_key_to_vllms_env(hub):
    cfg, notes = _serve(f"serve --model {REPO}", environ={"VLLM_API_KEY": "from-env"})
    assert (cfg.model, cfg.router.served_model_name, cfg.router.api_key, notes) == (
        str(hub),
        REPO,
        "from-env",
        [],
    )
    assert (
        cfg.router.host == "127.0.0.1" and cfg.router.port == 8000
    )  # (ours: vLLM listens on every interface)
    cfg, _ = _serve(
        f"serve {REPO} --max-model-len 4K --kv-cache-dtype auto --dtype half --enable-prefix-caching"
    )
    assert (cfg.attention.max_model_len, cfg.attention.kv_cache_dtype, cfg.shared.dtype) == (
        4096,
        "auto",
        "float16",
    )
    assert cfg.attention.prefix_caching is True
    with pytest.raises(ValueError, match="two models"):
        _serve(f"serve {REPO} --model other/model")


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--seed 0", "--seed: there is no engine-wide seed"),
        ("--chat-template x.jinja", "--chat-template: chat template 'x.jinja': no such file"),
        ("--kv-cache-dtype fp8_e5m2", "--kv-cache-dtype: 'fp8_e5m2'"),
        ("--tool-call-parser hermes", "--tool-call-parser: 'hermes'"),
        ("--reasoning-parser qwen3", "--reasoning-parser: 'qwen3'"),
        ("--dtype int8", "--dtype: 'int8'"),
        ("--gpu-memory-utilization 1.5", "--gpu-memory-utilization: 1.5"),
        ("--tensor-parallel-size 2 --attention-tp 4", r"--tensor-parallel-size \(2\) and --attention-tp \(4\) disagree"),
        ("--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 2}'",
         "--speculative-config: .*'ngram'" if HAS_SPECULATIVE else "speculative decoding is not available"),
        ("--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": -1}'",
         "--speculative-config: .*-1" if HAS_SPECULATIVE else "speculative decoding is not available"),
        ("--speculative-config '{\"model\": \"org/draft\", \"num_speculative_tokens\": 1}'",
         "--speculative-config: a draft model" if HAS_SPECULATIVE else "speculative decoding is not available"),
    ],
)  # fmt: skip
def test_flags_that_cannot_be_honoured_are_refused_by_name(hub, flags, message, capsys):
    with pytest.raises(ValueError, match=message):
        _serve(f"serve {REPO} {flags}")
    assert main(["serve", REPO, *shlex.split(flags)]) == 2  # (the CLI: an error, nothing started)
    assert flags.split()[0] in capsys.readouterr().err


def test_speculative_config_maps_to_speculative_tokens_where_it_exists(hub):
    command = (
        f'serve {REPO} --speculative-config \'{{"method": "deepseek_mtp", "num_speculative_tokens": 1}}\''
    )
    if not HAS_SPECULATIVE:
        with pytest.raises(ValueError, match="--speculative-config: speculative decoding is not available"):
            _serve(command)
        return
    try:
        cfg, _ = _serve(command)
    except ValueError as e:  # the setting exists but the cluster refuses it (for now): named by the vLLM flag
        assert str(e).startswith("--speculative-config: speculative_tokens"), e
    else:
        assert cfg.speculative_tokens == 1  # (the cluster speculates: #54)
        assert cfg.shared.speculative_disable_by_batch_size == 0  # (auto)
        spec = '{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 8}'
        cfg, notes = _serve(f"serve {REPO} --speculative-config '{spec}'")
        assert (cfg.speculative_tokens, cfg.shared.speculative_disable_by_batch_size) == (2, 8), notes


def test_gpu_workers_refuse_enforce_eager(hub, tmp_path):
    (tmp_path / "gpu.yaml").write_text("attention_gpus: 1\n")
    with pytest.raises(ValueError, match="--enforce-eager: GPU attention workers replay decode steps"):
        _serve(f"serve {REPO} --config {tmp_path / 'gpu.yaml'} --enforce-eager")
    _, notes = _serve(f"serve {REPO} --enforce-eager")
    assert notes == ["--enforce-eager: nothing to do: no CUDA graphs on CPU workers"]


def test_a_generation_config_with_sampling_defaults_is_refused(tmp_path, tiny_model):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_model.iterdir():
        (model / f.name).symlink_to(f)
    (model / "generation_config.json").write_text('{"bos_token_id": 0, "eos_token_id": 1}')
    _, notes = _serve(f"serve {model} --generation-config auto")
    assert notes == [f"--generation-config: auto: {model}/generation_config.json sets no sampling default"]
    (model / "generation_config.json").write_text('{"eos_token_id": 1, "temperature": 0.6, "top_p": 0.95}')
    with pytest.raises(ValueError, match=r"--generation-config: auto: .* \(temperature=0.6, top_p=0.95\)"):
        _serve(f"serve {model} --generation-config auto")
    with pytest.raises(ValueError, match="sets sampling defaults"):
        _serve(f"serve {model} --generation-config {model}")


def test_a_flag_serve_does_not_know_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", REPO, "--tokenizer-mode", "slow"])
    assert "unrecognized arguments: --tokenizer-mode" in capsys.readouterr().err


def test_docs_table_names_every_vllm_flag():
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| `--")]
    documented = {re.match(r"\| `(--[\w-]+)", row).group(1) for row in rows}
    flags = set(vllm_flags())
    assert len(flags) >= 27 and flags == documented, (flags - documented, documented - flags)


def test_a_chat_template_from_the_command_line_reaches_the_router(hub, tmp_path):
    """vLLM's --chat-template, a file or inline: the router's tokenizer templates chats with it
    (the file read by the CLI: the router may run on another node)."""
    from services.engine.tokenizer import Tokenizer

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    for given in (str(tmp_path / "t.jinja"), template):
        cfg, _ = _serve(f"serve {REPO}", extra=["--chat-template", given])
        assert cfg.router.chat_template == template
        tok = Tokenizer.from_dir(cfg.model, cfg.router.chat_template)
        assert (
            tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
            == "<user>hi"
        )
