"""Train the `small` preset briefly on this repository's own text, so benchmarks can measure a model
whose next-token predictions are confident (a random model's distribution is flat, so any rounding
flips its top-1: bench_fp8_cache's random rows).

The checkpoint starts as our own generator writes it (`services.presets.init_model`), is loaded
and trained by Hugging Face transformers (a dev dependency: AdamW, random windows of `seq_len`
byte-level tokens from docs/*.md, README.md and services/**/*.py, the router's bias left as
transformers leaves it), and is saved back by `save_pretrained` with the tokenizer files, then
checked: LocalEngine's greedy tokens on a README prompt must equal transformers' `generate`.
`training.json` in the output records the settings, losses and wall time (and the README prompt's
text); `held_out.json` beside it pins the held-out text as it was when the model trained (its
exact text, the text's sha256 and its token ids): benchmarks read that, never the live checkout,
whose edits since would move the split (`load_held_out`).

`--mtp` trains a multi-token-prediction module with it, as DeepSeek-V3 does (issue #54): transformers'
`MtpLayer` (enorm, hnorm, eh_proj, a full decoder layer, a final norm) over the main model's
final-normed states and the embedding of the next token (zeroed at position 0, as vLLM runs it),
its logits from the shared LM head scored on the token after next, the loss added with weight
`--mtp-weight` (DeepSeek-V3's lambda: 0.3). It is saved in the Hugging Face layout
(`model.layers.{num_hidden_layers}.*` with `shared_head.head` and `embed_tokens` copies,
`num_nextn_predict_layers: 1`), and training.json records its held-out loss before and after.

    python -m benchmarks.train_small [--out DIR] [--steps 250] [--seq-len 1024] [--batch 2] [--seed 0]
                                     [--mtp] [--mtp-weight 0.3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch

from services.presets import init_model

REPO = Path(__file__).resolve().parent.parent


def corpus_files(repo: Path = REPO) -> list[Path]:
    """The training text: docs/*.md, README.md and services/**/*.py (in every checkout), sorted."""
    return sorted([*repo.glob("docs/*.md"), repo / "README.md", *repo.glob("services/**/*.py")])


def encode(model_dir: Path, text: str) -> list[int]:
    """Token ids of `text` under the checkpoint's byte-level tokenizer.json (no BOS)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def corpus_text(repo: Path = REPO) -> str:
    """The whole training text, as the checkout at `repo` has it now."""
    return "\n\n".join(p.read_text(errors="replace") for p in corpus_files(repo))


HELD_OUT = 0.05  # the corpus's last 5 %: not trained on
HELD_OUT_FILE = "held_out.json"  # beside the checkpoint: the held-out text as trained


def split_corpus(model_dir: Path, text: str) -> tuple[torch.Tensor, int, str]:
    """`text`'s token ids, the index of the first held-out token (the last HELD_OUT share is held
    out) and the held-out text: `text` from that token's first character on."""
    from tokenizers import Tokenizer

    enc = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False)
    split = int(len(enc.ids) * (1 - HELD_OUT))
    return torch.tensor(enc.ids), split, text[enc.offsets[split][0] :]


def save_held_out(out: Path, text: str, ids: list[int]) -> dict:
    """Write `held_out.json` into checkpoint `out` (the exact text, its sha256, its token ids as
    trained); returns what training.json records of it."""
    info = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "chars": len(text), "tokens": len(ids)}
    record = {
        **info,
        "held_out_share": HELD_OUT,
        "corpus": [str(p.relative_to(REPO)) for p in corpus_files()],
    }
    (out / HELD_OUT_FILE).write_text(json.dumps({**record, "text": text, "token_ids": ids}) + "\n")
    return info


def load_held_out(model_dir: Path) -> dict:
    """The held-out text `train_small` saved beside checkpoint `model_dir`: {"text", "sha256",
    "token_ids", ...}, the text checked against its hash. Refuses (FileNotFoundError) a checkpoint
    without one: re-choosing it from the live checkout would score text the model may have
    trained on."""
    path = Path(model_dir) / HELD_OUT_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no held-out text saved with this checkpoint (trained before it was pinned?); "
            "train it again with benchmarks/train_small.py"
        )
    held = json.loads(path.read_text())
    if hashlib.sha256(held["text"].encode()).hexdigest() != held["sha256"]:
        raise ValueError(f"{path}: the held-out text does not match its sha256")
    if not held.get("token_ids"):
        raise ValueError(f"{path}: no token ids")
    return held


def readme_prompt(model_dir: Path, repo: Path = REPO) -> tuple[str, list[int]]:
    """A real text prefix: the README's first line of prose (it starts with a capital letter), and
    its token ids."""
    lines = (repo / "README.md").read_text().splitlines()
    line = next(s for s in lines if s[:1].isupper())
    return line, encode(model_dir, line)


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def _windows(tokens: torch.Tensor, n: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """n random windows of seq_len tokens, [n, seq_len]."""
    starts = torch.randint(0, len(tokens) - seq_len, (n,), generator=g)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def _mean_loss(model, batches: list[torch.Tensor]) -> float:
    """Mean next-token loss over fixed batches (eval mode)."""
    model.eval()
    loss = sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)
    model.train()
    return loss


@torch.no_grad()
def _mean_mtp_loss(model, mtp, batches: list[torch.Tensor]) -> float:
    """Mean MTP loss (the token after next) over fixed batches (eval mode)."""
    model.eval(), mtp.eval()
    loss = sum(mtp_loss(model, mtp, b, 0.0)[1].item() for b in batches) / len(batches)
    model.train(), mtp.train()
    return loss


def check_round_trip(model, out_dir: Path, prompt: list[int], new_tokens: int = 24) -> list[int]:
    """LocalEngine on the saved checkpoint and transformers' trained `model` must pick the same
    greedy tokens after `prompt` (the weights round-trip through save_pretrained and our loader);
    returns them, RuntimeError otherwise."""
    from services.engine.engine import EngineConfig, LocalEngine
    from services.engine.sampling import SamplingParams

    model.eval()
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
    engine = LocalEngine(EngineConfig(model=str(out_dir)))
    ours = engine.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))[
        0
    ].token_ids
    if ours != hf:
        raise RuntimeError(f"{out_dir}: LocalEngine's greedy tokens {ours} differ from transformers' {hf}")
    return ours


def load_mtp_layer(init: Path, dtype: torch.dtype):
    """transformers' MtpLayer holding checkpoint `init`'s MTP module (model.layers.{L}.*): its
    decoder layer loaded as layer L of a copy of the model with L + 1 layers (transformers converts
    the experts' layout on load), enorm / hnorm / eh_proj / shared_head.norm from the file."""
    from safetensors import safe_open
    from transformers import DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    hf = json.loads((init / "config.json").read_text())
    L = hf["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as tmp:
        longer = Path(tmp)
        for f in init.iterdir():
            (longer / f.name).symlink_to(f)
        (longer / "config.json").unlink()
        (longer / "config.json").write_text(
            json.dumps({**hf, "num_hidden_layers": L + 1, "num_nextn_predict_layers": 0})
        )
        big = DeepseekV3ForCausalLM.from_pretrained(longer, dtype=dtype, experts_implementation="grouped_mm")
    layer = MtpLayer(big.config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, L).to(dtype)
    layer.mtp_block = big.model.layers[L]
    with safe_open(str(init / "model.safetensors"), "pt") as f:
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                             ("shared_head.norm", "post_norm")):  # fmt: skip
            getattr(layer, theirs).weight.data.copy_(f.get_tensor(f"model.layers.{L}.{ours}.weight"))
    return layer, big


def mtp_loss(model, mtp, ids: torch.Tensor, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(main next-token loss + weight x MTP loss, the MTP loss) of windows `ids` [B, S]. The MTP
    module at position t sees the main model's final-normed state h_t and the embedding of token
    t+1 (zero at position 0) and predicts token t+2 through the shared head."""
    import torch.nn.functional as F

    h = model.model(input_ids=ids).last_hidden_state  # [B, S, H]
    logits = model.lm_head(h[:, :-1])
    main = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    S = ids.shape[1] - 1
    e = model.model.embed_tokens(ids[:, 1:])  # [B, S, H]: token t+1 at position t
    e = e * (torch.arange(S) > 0).to(e.dtype)[None, :, None]
    pos = torch.arange(S)[None]
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None].to(e.dtype)
    out = mtp(e, h[:, :-1], model.model.rotary_emb(e, position_ids=pos), mask, pos, None)
    second = F.cross_entropy(model.lm_head(out[:, :-1]).flatten(0, 1), ids[:, 2:].flatten())
    return main + weight * second, second


def save_mtp(out: Path, model, mtp, big) -> int:
    """Add the trained MTP module to checkpoint `out` (written by save_pretrained) in the Hugging
    Face layout; returns the number of tensors added. Its decoder layer is written as
    transformers writes layer L of `big` (the experts back in the checkpoint's layout)."""
    from safetensors.torch import load_file, save_file

    L = model.config.num_hidden_layers
    big.model.layers[L] = mtp.mtp_block  # (the trained block: `big` is only its writer)
    with tempfile.TemporaryDirectory() as tmp:
        big.save_pretrained(tmp)
        block = {k: v for k, v in load_file(str(Path(tmp) / "model.safetensors")).items()
                 if k.startswith(f"model.layers.{L}.")}  # fmt: skip
    p = f"model.layers.{L}."
    own = {
        p + "enorm.weight": mtp.enorm.weight,
        p + "hnorm.weight": mtp.hnorm.weight,
        p + "eh_proj.weight": mtp.eh_proj.weight,
        p + "shared_head.norm.weight": mtp.post_norm.weight,
        p + "shared_head.head.weight": model.lm_head.weight,
        p + "embed_tokens.weight": model.model.embed_tokens.weight,
    }
    weights = load_file(str(out / "model.safetensors"))
    added = {**block, **{k: v.detach().clone().contiguous() for k, v in own.items()}}
    save_file({**weights, **added}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2) + "\n")
    return len(added)


def train_small(
    out_dir: str | Path,
    steps: int = 250,
    seq_len: int = 1024,
    batch: int = 2,
    seed: int = 0,
    lr: float = 1e-3,
    log_every: int = 25,
    mtp: bool = False,
    mtp_weight: float = 0.3,
) -> Path:
    """Train the small preset (our generator's weights, `seed`) for `steps` AdamW steps of `batch`
    random `seq_len`-token windows of the repository's text; write the checkpoint (config.json,
    model.safetensors, tokenizer files, training.json) to `out_dir` and return it.

    The last 5 % of the text is held out: training.json's start/end losses are the mean loss
    over 8 fixed held-out windows before and after training (cleaner than one noisy batch), plus
    the training loss every `log_every` steps. `mtp`: an MTP module trained with it (load_mtp_layer,
    mtp_loss, save_mtp), its loss weighted `mtp_weight`."""
    from transformers import DeepseekV3ForCausalLM

    torch.set_num_threads(2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        init = init_model(Path(tmp) / "small", "small", seed=seed, mtp=mtp)
        # grouped_mm: ~3x faster than the per-expert eager loop for training on CPU
        model = DeepseekV3ForCausalLM.from_pretrained(
            init, dtype=torch.float32, experts_implementation="grouped_mm"
        )
        layer, big = load_mtp_layer(init, torch.float32) if mtp else (None, None)
        tokens, split, held_out_text = split_corpus(init, corpus_text())
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(init / name, out / name)
    train, held_out = tokens[:split], tokens[split:]
    held_out_info = save_held_out(out, held_out_text, held_out.tolist())  # pinned now, as trained
    g = torch.Generator().manual_seed(seed)
    eval_batches = list(_windows(held_out, 8, seq_len, g).split(batch))
    model.train()
    params = [*model.parameters(), *(layer.parameters() if mtp else ())]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    start_loss = _mean_loss(model, eval_batches)
    mtp_start = _mean_mtp_loss(model, layer, eval_batches) if mtp else None
    print(f"corpus {len(tokens)} tokens; held-out loss before training {start_loss:.3f}", flush=True)
    log = []
    t_train = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr, warmup)
        ids = _windows(train, batch, seq_len, g)
        loss = mtp_loss(model, layer, ids, mtp_weight)[0] if mtp else model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            log.append({"step": step, "loss": loss.item(), "s": round(time.perf_counter() - t_train, 1)})
            print(f"step {step} loss {loss.item():.3f} ({log[-1]['s']} s)", flush=True)
    train_s = time.perf_counter() - t_train
    end_loss = _mean_loss(model, eval_batches)
    print(f"held-out loss {start_loss:.3f} -> {end_loss:.3f}; {train_s:.0f} s training", flush=True)
    model.save_pretrained(out)
    if mtp:
        mtp_end = _mean_mtp_loss(model, layer, eval_batches)
        print(f"MTP held-out loss (token after next) {mtp_start:.3f} -> {mtp_end:.3f}", flush=True)
        save_mtp(out, model, layer, big)
    prompt_text, prompt = readme_prompt(out)
    greedy = check_round_trip(model, out, prompt)
    info = {
        "steps": steps,
        "seq_len": seq_len,
        "batch": batch,
        "seed": seed,
        "lr": lr,
        "corpus_tokens": len(tokens),
        "held_out_text": {**held_out_info, "file": HELD_OUT_FILE},
        "held_out_loss_start": start_loss,
        "held_out_loss_end": end_loss,
        "train_loss_log": log,
        "train_wall_s": train_s,
        "total_wall_s": time.perf_counter() - t0,
        "round_trip": {"prompt": prompt_text, "greedy_tokens_match_transformers": len(greedy)},
    }
    if mtp:
        info["mtp"] = {"weight": mtp_weight, "held_out_loss_start": mtp_start, "held_out_loss_end": mtp_end}
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/small-trained")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mtp", action="store_true", help="train an MTP module with it (issue #54)")
    ap.add_argument(
        "--mtp-weight", type=float, default=0.3, help="the MTP loss's weight (DeepSeek-V3's lambda)"
    )
    args = ap.parse_args()
    out = train_small(args.out, args.steps, args.seq_len, args.batch, args.seed, mtp=args.mtp,
                      mtp_weight=args.mtp_weight)  # fmt: skip
    print(out, (out / "training.json").read_text())


if __name__ == "__main__":
    main()
