#!/usr/bin/env python3
"""Train tinyvllm's demo model: a small Llama 3.x on the Python documentation, saved in Hugging Face format.

    python scripts/train_demo_model.py     # the shipped model: a CUDA GPU, a few minutes (at most --max-minutes)
    python scripts/train_demo_model.py --device cpu --out /tmp/demo-smoke --max-steps 20 --epochs 1 \
        --hidden-size 64 --intermediate-size 128 --layers 2 --heads 4 --head-dim 16 --seq-len 128  # smoke test

Steps: read ``data/demo_corpus/{train,val}.txt.gz`` (``scripts/prepare_demo_corpus.py``); train a byte-level
BPE (:mod:`tinyvllm.models.dummy_tokenizer`'s layout, Llama 3 special tokens at the top) on the training
split; pack every page as ``<|begin_of_text|> page <|end_of_text|>`` into one token stream; train
transformers' ``LlamaForCausalLM`` (RMSNorm, RoPE with llama3 scaling, GQA, SwiGLU, tied embeddings) on
random windows of it with AdamW, warmup + cosine, bf16 autocast on CUDA, residual dropout (training only:
the architecture is unchanged), validation every half epoch. ``--attention tinyvllm`` trains through our
FlashAttention-2 kernels (``tinyvllm.kernels.flash_attention``, forward and backward; on the CPU the torch
reference, or the kernels themselves under ``TRITON_INTERPRET=1``), ``--attention sdpa`` through
``torch.nn.functional.scaled_dot_product_attention``; everything else (seed, data, dropout) is the same.
Each entry of ``--epochs`` is one run from the same seed; the run whose best validation loss is lowest is
kept, at its best evaluation.

Writes into ``--out`` (default ``tinyvllm/models/demo``): config.json, generation_config.json,
model.safetensors (bf16), tokenizer.json, tokenizer_config.json, special_tokens_map.json, loss.png,
training_log.json, the model card README.md and LICENSE (the corpus's PSF License Agreement). When ``$OUT``
is set, also writes there ``demo_model.tar`` (all of those files; split into ``demo_model.tar.partNN`` of
< 15 MB when larger), loss.png and training_log.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing tinyvllm

import torch  # noqa: E402
from demo_model_card import write_model_card  # noqa: E402  (scripts/, beside this file)
from prepare_demo_corpus import read_documents  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tinyvllm.models.dummy_tokenizer import special_token_ids, write_tokenizer_files  # noqa: E402
from tinyvllm.models.presets import make_config, num_parameters, weight_shapes  # noqa: E402

ATTENTION_CHOICES = ("sdpa", "tinyvllm")
OUT_PART_BYTES = 15 * 10**6  # files copied to $OUT must stay under 16 MB each
SAMPLING_DEFAULTS = {"temperature": 0.7, "top_p": 0.9}  # generation_config.json
SAMPLE_PROMPTS = (
    "The list type",
    "A dictionary is",
    "To open a file,",
    "The following functions",
    "Exceptions are raised when",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=REPO / "data" / "demo_corpus")
    ap.add_argument("--out", type=Path, default=REPO / "tinyvllm" / "models" / "demo")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default="sdpa",
        help="the attention the training model runs: SDPA, or tinyvllm's flash_attention (forward and backward)",
    )
    g = ap.add_argument_group("model")
    g.add_argument("--vocab-size", type=int, default=4352, help="BPE tokens + 256 special tokens")
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--intermediate-size", type=int, default=768)
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=32)
    g.add_argument("--max-position-embeddings", type=int, default=1024)
    g = ap.add_argument_group("training")
    g.add_argument("--seq-len", type=int, default=1024, help="training window (<= max position embeddings)")
    g.add_argument("--batch-size", type=int, default=16, help="windows per step")
    g.add_argument(
        "--epochs",
        default="8,16,32",
        help="comma-separated: one run per value (epochs over the training tokens); the best is kept",
    )
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup-steps", type=int, default=100)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--dropout", type=float, default=0.1, help="residual dropout (training only)")
    g.add_argument("--evals-per-epoch", type=float, default=2.0)
    g.add_argument("--max-steps", type=int, default=None, help="cap the steps of every run (smoke tests)")
    g.add_argument(
        "--max-eval-windows", type=int, default=None, help="validate on this many windows only (smoke tests)"
    )
    g.add_argument("--max-minutes", type=float, default=7.0, help="wall-clock budget for all runs together")
    args = ap.parse_args(argv)
    args.epochs = [float(e) for e in str(args.epochs).split(",")]
    if args.seq_len > args.max_position_embeddings:
        ap.error("--seq-len must be <= --max-position-embeddings")
    return args


def model_config(args: argparse.Namespace) -> dict:
    """The config.json: Llama 3.x's fields, llama3 RoPE scaling (original 1/4 of the context, factor 4)."""
    return make_config(
        "tiny",
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=10000.0,
        rope_scaling={
            "factor": 4.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": args.max_position_embeddings // 4,
            "rope_type": "llama3",
        },
        torch_dtype="bfloat16",
    )


# ----------------------------------------------------------------------------------------- data
def token_stream(tokenizer, docs: list[str], bos: int, eos: int) -> torch.Tensor:
    """``<|begin_of_text|> doc <|end_of_text|>`` for every document, concatenated: int64 [N]."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    return torch.tensor(ids, dtype=torch.int64)


def unigram_entropy(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> dict:
    """Cross-entropy of the validation tokens under the training split's unigram distribution (add-one
    smoothed) — the loss of the best model that ignores context — and the validation split's own
    unigram entropy, in nats per token."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1
    logp = counts.log() - counts.sum().log()
    val_counts = torch.bincount(val, minlength=vocab_size).double()
    p_val = val_counts / val_counts.sum()
    own = -(p_val[p_val > 0] * p_val[p_val > 0].log()).sum()
    return {"cross_entropy_nats": float(-(p_val * logp).sum()), "val_entropy_nats": float(own)}


def random_windows(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


# ----------------------------------------------------------------------------------------- model
def tinyvllm_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface over `tinyvllm.kernels.flash_attention`: query [B, Hq, L, D] and
    key, value [B, Hk, L, D] (K/V heads not repeated) → ([B, L, Hq, D], no weights). Causal, unpadded
    windows only, as this script trains. Under autocast the inputs are cast to its dtype, as SDPA's are."""
    from tinyvllm.kernels import flash_attention

    if attention_mask is not None or dropout:
        raise ValueError("the tinyvllm training attention takes unpadded causal windows without attention dropout")
    device = query.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else query.dtype
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))  # [B, L, H, D]
    interpret = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    backend = "triton" if device.type == "cuda" or interpret else "torch"
    return flash_attention(q, k, v, causal=True, scale=scaling, backend=backend), None


def attention_implementation(name: str) -> str:
    """The transformers `attn_implementation` for --attention: "sdpa", or ours registered under "tinyvllm"
    (with FlashAttention's mask function: no mask for unpadded causal batches)."""
    if name == "sdpa":
        return "sdpa"
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("tinyvllm", tinyvllm_attention_forward)
    AttentionMaskInterface.register("tinyvllm", flash_attention_mask)
    return "tinyvllm"


def build_model(config: dict, dropout: float, device: torch.device, attention: str = "sdpa"):
    import transformers

    hf_config = transformers.LlamaConfig(  # it edits rope_scaling in place: a copy
        **copy.deepcopy(config), attn_implementation=attention_implementation(attention)
    )
    model = transformers.LlamaForCausalLM(hf_config).to(device)
    model.config.use_cache = False

    def residual_dropout(module, inputs, output):
        if not module.training or dropout == 0:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], dropout, True), *output[1:])
        return F.dropout(output, dropout, True)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(residual_dropout)
        layer.mlp.register_forward_hook(residual_dropout)
    return model


def loss_on(model, windows: torch.Tensor, device: torch.device, amp: bool = True) -> torch.Tensor:
    """Mean next-token cross-entropy over windows [B, L+1]; bf16 autocast on CUDA when ``amp``."""
    windows = windows.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp and device.type == "cuda"):
        logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def evaluate(
    model,
    val: torch.Tensor,
    seq_len: int,
    batch: int,
    device: torch.device,
    amp: bool = True,
    max_windows: int | None = None,
) -> float:
    """Mean loss (nats/token) over consecutive windows covering the validation stream (its first
    `max_windows` windows when given)."""
    model.eval()
    n = (len(val) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    windows = torch.stack([val[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])
    total = 0.0
    for i in range(0, n, batch):
        chunk = windows[i : i + batch]
        total += float(loss_on(model, chunk, device, amp)) * len(chunk)
    model.train()
    return total / n


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, args: argparse.Namespace, device: torch.device) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def train_run(
    config: dict,
    epochs: float,
    train: torch.Tensor,
    val: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
    deadline: float,
) -> dict:
    """One run; returns its log (evaluations, best validation loss) and the best state dict (on the CPU)."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = build_model(config, args.dropout, device, args.attention)
    opt = make_optimizer(model, args, device)
    tokens_per_step = args.batch_size * args.seq_len
    total = math.ceil(epochs * len(train) / tokens_per_step)
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    eval_every = max(1, round(len(train) / tokens_per_step / args.evals_per_epoch))
    log_every = max(1, eval_every // 5)
    log = {
        "epochs": epochs,
        "planned_steps": total,
        "eval_every": eval_every,
        "evals": [],
        "train_curve": [],
        "stopped": "done",
    }
    best, best_state, running, since_eval = math.inf, None, [], []
    start = time.time()
    bar = tqdm(range(total), desc=f"{epochs:g} epochs", unit="step", mininterval=2.0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args)
        loss = loss_on(model, random_windows(train, args.batch_size, args.seq_len, gen), device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running.append(loss.detach())
        last = step + 1 == total or time.time() > deadline
        if (step + 1) % log_every == 0 or last:
            mean = float(torch.stack(running).mean())
            since_eval.append(mean)
            running = []
            log["train_curve"].append(
                {"step": step + 1, "epoch": (step + 1) * tokens_per_step / len(train), "train_loss": mean}
            )
        if (step + 1) % eval_every == 0 or last:
            val_loss = evaluate(model, val, args.seq_len, args.batch_size, device, max_windows=args.max_eval_windows)
            train_loss = sum(since_eval) / len(since_eval)
            since_eval = []
            log["evals"].append(
                {
                    "step": step + 1,
                    "epoch": (step + 1) * tokens_per_step / len(train),
                    "tokens": (step + 1) * tokens_per_step,
                    "train_loss": train_loss,
                    "val_loss": val_loss,
                    "lr": opt.param_groups[0]["lr"],
                    "elapsed_s": time.time() - start,
                }
            )
            bar.set_postfix(train=f"{train_loss:.3f}", val=f"{val_loss:.3f}")
            if val_loss < best:
                best = val_loss
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                log["best_step"] = step + 1
        if time.time() > deadline:
            log["stopped"] = "time budget"
            break
    bar.close()
    log.update(
        best_val_loss=best,
        steps=step + 1,
        seconds=time.time() - start,
        tokens_per_second=(step + 1) * tokens_per_step / (time.time() - start),
    )
    return {"log": log, "state": best_state}


# ----------------------------------------------------------------------------------------- saving
def save_weights(state: dict, config: dict, path: Path) -> None:
    """model.safetensors in bf16, tensors in checkpoint order (tied lm_head left out)."""
    from safetensors.torch import save_file

    names = [name for name, _ in weight_shapes(config)]
    tensors = {name: state[name].to(torch.bfloat16).contiguous() for name in names}
    for name, shape in weight_shapes(config):
        assert tuple(tensors[name].shape) == shape, (name, tensors[name].shape, shape)
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


@torch.no_grad()
def check_saved_model(out: Path, val: torch.Tensor, args: argparse.Namespace, device: torch.device) -> dict:
    """Load the written files with transformers (as a user would): validation loss of the shipped bf16
    weights computed in float32, and greedy and sampled continuations of a few prompts."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    val_loss = evaluate(model, val, args.seq_len, args.batch_size, device, amp=False)
    samples = []
    torch.manual_seed(args.seed)
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        greedy = model.generate(ids, max_new_tokens=48, do_sample=False)
        sampled = model.generate(ids, max_new_tokens=48, do_sample=True, **SAMPLING_DEFAULTS)
        samples.append(
            {
                "prompt": prompt,
                "greedy": tok.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True),
                "sampled": tok.decode(sampled[0, ids.shape[1] :], skip_special_tokens=True),
            }
        )
    return {"shipped_val_loss": val_loss, "samples": samples}


def plot_losses(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    chosen = log["chosen_run"]
    for i, run in enumerate(log["runs"]):
        ev, tc = run["evals"], run["train_curve"]
        alpha, lw = (1.0, 1.8) if i == chosen else (0.35, 1.0)
        label = f"{run['epochs']:g}-epoch run" + (" (shipped)" if i == chosen else "")
        ax.plot([e["epoch"] for e in tc], [e["train_loss"] for e in tc], color=f"C{i}", ls="--", alpha=alpha, lw=lw)
        ax.plot(
            [e["epoch"] for e in ev],
            [e["val_loss"] for e in ev],
            color=f"C{i}",
            alpha=alpha,
            lw=lw,
            label=label,
            marker="." if len(ev) < 30 else None,
        )
    ax.axhline(log["unigram"]["cross_entropy_nats"], color="gray", ls=":", label="unigram entropy (val)")
    best = log["runs"][chosen]["best_val_loss"]
    ax.axhline(best, color="black", lw=0.6, ls="-.", label=f"shipped: val {best:.3f}")
    ax.set_xlabel("epochs over the training tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("demo model: validation (solid) and training (dashed) loss")
    ax.set_ylim(top=max(8.5, log["unigram"]["cross_entropy_nats"] + 0.5), bottom=max(0.0, best - 1.5))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def export_to_out(out: Path, out_env: Path) -> list[str]:
    """Copy the results under $OUT: one tar of the model directory (split below 16 MB per file),
    plus loss.png and training_log.json to look at."""
    out_env.mkdir(parents=True, exist_ok=True)
    tar_path = out_env / "demo_model.tar"
    with tarfile.open(tar_path, "w") as tar:
        for f in sorted(out.iterdir()):
            tar.add(f, arcname=f"demo/{f.name}")
    written = []
    if tar_path.stat().st_size > OUT_PART_BYTES:
        data = tar_path.read_bytes()
        tar_path.unlink()
        for k, i in enumerate(range(0, len(data), OUT_PART_BYTES)):
            part = out_env / f"demo_model.tar.part{k:02d}"
            part.write_bytes(data[i : i + OUT_PART_BYTES])
            written.append(part.name)
    else:
        written.append(tar_path.name)
    for name in ("loss.png", "training_log.json"):
        shutil.copy(out / name, out_env / name)
        written.append(name)
    return written


def git_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    deadline = t0 + 60 * args.max_minutes
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    config = model_config(args)
    train_docs = read_documents(args.corpus / "train.txt.gz")
    val_docs = read_documents(args.corpus / "val.txt.gz")

    work = Path(tempfile.mkdtemp(prefix="demo-model-"))
    tokenizer = write_tokenizer_files(work, args.vocab_size, args.max_position_embeddings, corpus=train_docs)
    ids = special_token_ids(args.vocab_size)
    bos, eos = ids["bos_token_id"], ids["eos_token_id"][0]  # <|end_of_text|> ends every page
    train = token_stream(tokenizer, train_docs, bos, eos)
    val = token_stream(tokenizer, val_docs, bos, eos)
    unigram = unigram_entropy(train, val, args.vocab_size)
    print(
        f"tokens: train {len(train):,}, val {len(val):,}; unigram cross-entropy on val "
        f"{unigram['cross_entropy_nats']:.3f} nats/token; {num_parameters(config):,} parameters; {device}"
    )

    runs = []
    for epochs in args.epochs:
        if time.time() > deadline:
            break
        runs.append(train_run(config, epochs, train, val, args, device, deadline))
    chosen = min(range(len(runs)), key=lambda i: runs[i]["log"]["best_val_loss"])
    print(
        "runs:",
        ", ".join(f"{r['log']['epochs']:g} epochs → best val {r['log']['best_val_loss']:.4f}" for r in runs),
        f"; shipping run {chosen}",
    )

    (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "do_sample": True,
        "eos_token_id": config["eos_token_id"],
        **SAMPLING_DEFAULTS,
    }
    (work / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    save_weights(runs[chosen]["state"], config, work / "model.safetensors")
    check = check_saved_model(work, val, args, device)

    log = {
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "config": config,
        "generation_config": generation_config,
        "num_parameters": num_parameters(config),
        "corpus": {
            "train_documents": len(train_docs),
            "val_documents": len(val_docs),
            "train_chars": sum(map(len, train_docs)),
            "val_chars": sum(map(len, val_docs)),
            "train_tokens": len(train),
            "val_tokens": len(val),
        },
        "unigram": unigram,
        "runs": [r["log"] for r in runs],
        "chosen_run": chosen,
        "best_val_loss": runs[chosen]["log"]["best_val_loss"],
        **check,
        "environment": {
            "attention": args.attention,
            "autocast": "bfloat16" if device.type == "cuda" else None,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "git_commit": git_commit(),
        },
        "total_seconds": time.time() - t0,
    }
    (work / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    plot_losses(log, work / "loss.png")
    write_model_card(work, log)

    args.out.mkdir(parents=True, exist_ok=True)
    for f in work.iterdir():
        shutil.move(str(f), args.out / f.name)
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out}: " + ", ".join(sorted(f.name for f in args.out.iterdir())))
    print(
        f"shipped val loss {check['shipped_val_loss']:.4f} nats/token (unigram "
        f"{unigram['cross_entropy_nats']:.3f}); total {time.time() - t0:.0f} s"
    )
    for s in check["samples"][:3]:
        print(f"  {s['prompt']!r} → {s['greedy']!r}")
    if os.environ.get("OUT"):
        print("copied to $OUT:", ", ".join(export_to_out(args.out, Path(os.environ["OUT"]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
