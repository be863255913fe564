#!/usr/bin/env python3
"""The demo model's card (README.md), filled from its training_log.json.

    python scripts/demo_model_card.py [MODEL_DIR]   # rewrite MODEL_DIR/README.md (default tinyvllm/models/demo)

``scripts/train_demo_model.py`` calls :func:`write_model_card` after training; run this to regenerate
the card after editing the template, without training again.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS_DIR = REPO / "data" / "demo_corpus"

CARD = """\
# tinyvllm demo model

A {params_m:.1f} M-parameter Llama 3.x model trained on the Python documentation, shipped inside the
`tinyvllm` package so that `tinyvllm generate "The list type"` and `LLM()` produce readable English on
any CPU with nothing to download. It is the default model of the engine (`model="demo"`).

**Intended use:** demos, tutorials and tests of the engine (its predictions are confident, so greedy
generation is a sharp check of numerical parity with `transformers`). **Not** for anything else: it
knows only the style and vocabulary of the Python documentation, is not instruction-tuned (the chat
template is there, but it answers in documentation prose), and states plausible-sounding falsehoods.

## Architecture

The code path of Llama 3.x (`LlamaForCausalLM`): RMSNorm, rotary embeddings with llama3 scaling,
grouped-query attention, SwiGLU MLP, tied input/output embeddings, no biases.

| field | value |
|---|---|
| parameters | {params:,} |
| layers | {num_hidden_layers} |
| hidden size | {hidden_size} |
| attention heads / KV heads / head dim | {num_attention_heads} / {num_key_value_heads} / {head_dim} |
| MLP (SwiGLU) intermediate size | {intermediate_size} |
| vocabulary | {vocab_size} ({regular_tokens} byte-level BPE + 256 Llama 3 special tokens at the top) |
| RoPE | theta {rope_theta:g}, llama3 scaling: factor {rope_factor:g}, original {rope_original} |
| max positions / training window | {max_position_embeddings} / {seq_len} tokens |
| weights | `model.safetensors`, bfloat16, {weights_mb:.1f} MB |

`<|begin_of_text|>` (id {bos}) starts every page in training and every prompt; `<|end_of_text|>`
(id {eot}) ends every page and is one of the EOS ids of `generation_config.json` (sampling defaults:
temperature {temperature}, top_p {top_p}).

## Corpus and licence

{corpus_line} Each page was reduced to its prose (code blocks, tables, navigation, index and licence
pages dropped; see `data/demo_corpus/SOURCE.md` in the repository and
`scripts/prepare_demo_corpus.py`): {train_docs} pages ({train_chars:,} characters, {train_tokens:,}
tokens) for training and {val_docs} held-out pages ({val_chars:,} characters, {val_tokens:,} tokens) for
validation, split by page.

The Python documentation is Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved,
and licensed under the PSF License Agreement (version 2); its code examples are additionally under the
Zero-Clause BSD licence. This model is a derivative work of it, distributed under the same PSF License
Agreement: see `LICENSE` beside this file. Summary of the changes made: the HTML pages were converted
to plain prose as described above, and the text was used to train a byte-level BPE tokenizer and the
weights of this model; no documentation text is distributed with the package.

## Training

transformers' `LlamaForCausalLM`, AdamW (betas 0.9/0.95, weight decay {weight_decay} on matrices),
learning rate {lr:g} with {warmup} warmup steps then cosine decay to {min_lr_ratio:g}x, gradient
clipping 1.0, {batch} windows of {seq_len} tokens per step (random offsets into the packed stream),
residual dropout {dropout} during training only, {precision}, seed {seed}. Each run below starts from the
same seed; the run with the lowest validation loss was kept, at its best evaluation.

| run | epochs | steps | best validation loss (nats/token) | at step | wall time |
|---|---|---|---|---|---|
{runs_table}

Trained on {device} (torch {torch}), {total_minutes:.1f} minutes in total. Reproduce, from the
repository root:

```bash
python scripts/prepare_demo_corpus.py   # once, on Debian 12: apt-get download + convert (already committed)
{command}
```

![training and validation loss](loss.png)

## Results

| on the {val_tokens:,} held-out validation tokens | nats/token | bits/token | perplexity |
|---|---|---|---|
| this model (shipped bf16 weights, float32 compute) | {val:.3f} | {val_bits:.3f} | {val_ppl:.1f} |
| unigram entropy of the tokenizer (training-split unigram, add-one) | {uni:.3f} | {uni_bits:.3f} | {uni_ppl:.0f} |

The model's loss is {ratio:.0%} of the unigram entropy (bits per character: {bpc:.3f}).

Continuations of 48 new tokens by transformers' `generate` from the shipped files, greedy:

{samples}

and sampled with the defaults of `generation_config.json` (temperature {temperature}, top_p {top_p}), as
`tinyvllm generate` does:

{sampled}

## Limitations

Trained on about {train_mtokens:.1f} M tokens of one domain: it repeats itself under greedy decoding,
drifts after a few sentences, invents function names and facts, and knows nothing outside the Python
documentation. Positions beyond {seq_len} were never trained.
"""


def corpus_line() -> str:
    source = (CORPUS_DIR / "SOURCE.md").read_text(encoding="utf-8") if (CORPUS_DIR / "SOURCE.md").is_file() else ""
    pkg = re.search(r"Debian package: `([^`]+)` version `([^`]+)`", source)
    sha = re.search(r"sha256: `([0-9a-f]+)`", source)
    if not pkg:
        return "The HTML pages of the Python documentation, from Debian's documentation package."
    return (
        f"The HTML pages of the Python 3.11 documentation from Debian 12's `{pkg.group(1)}` package, "
        f"version `{pkg.group(2)}` (`.deb` sha256 `{sha.group(1) if sha else '?'}`)."
    )


def _sample_lines(samples: list[dict], key: str) -> str:
    lines = []
    for s in samples:
        text = " ".join(s[key].split())
        lines.append(f"- **{s['prompt']}**{' ' if not text.startswith((',', '.')) else ''}{text}")
    return "\n".join(lines)


def render(log: dict, weights_bytes: int) -> str:
    c, a = log["config"], log["args"]
    runs_table = "\n".join(
        f"| {i}{' (shipped)' if i == log['chosen_run'] else ''} | {r['epochs']:g} | {r['steps']} | "
        f"{r['best_val_loss']:.4f} | {r.get('best_step', '-')} | {r['seconds'] / 60:.1f} min |"
        for i, r in enumerate(log["runs"])
    )
    val, uni = log["shipped_val_loss"], log["unigram"]["cross_entropy_nats"]
    corpus = log["corpus"]
    return CARD.format(
        params=log["num_parameters"],
        params_m=log["num_parameters"] / 1e6,
        **{
            k: c[k]
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
                "rope_theta",
                "max_position_embeddings",
            )
        },
        regular_tokens=c["vocab_size"] - 256,
        rope_factor=c["rope_scaling"]["factor"],
        rope_original=c["rope_scaling"]["original_max_position_embeddings"],
        weights_mb=weights_bytes / 1e6,
        bos=c["bos_token_id"],
        eot=c["eos_token_id"][0],
        temperature=log["generation_config"]["temperature"],
        top_p=log["generation_config"]["top_p"],
        corpus_line=corpus_line(),
        train_docs=corpus["train_documents"],
        val_docs=corpus["val_documents"],
        train_chars=corpus["train_chars"],
        val_chars=corpus["val_chars"],
        train_tokens=corpus["train_tokens"],
        val_tokens=corpus["val_tokens"],
        train_mtokens=corpus["train_tokens"] / 1e6,
        weight_decay=a["weight_decay"],
        lr=a["lr"],
        warmup=a["warmup_steps"],
        min_lr_ratio=a["min_lr_ratio"],
        batch=a["batch_size"],
        seq_len=a["seq_len"],
        dropout=a["dropout"],
        seed=a["seed"],
        runs_table=runs_table,
        precision=("bf16 autocast" if log["environment"].get("autocast") == "bfloat16" else "float32"),
        device=log["environment"]["device"],
        torch=log["environment"]["torch"],
        total_minutes=log["total_seconds"] / 60,
        command=log["command"],
        val=val,
        val_bits=val / math.log(2),
        val_ppl=math.exp(val),
        uni=uni,
        uni_bits=uni / math.log(2),
        uni_ppl=math.exp(uni),
        ratio=val / uni,
        bpc=val * corpus["val_tokens"] / corpus["val_chars"] / math.log(2),
        samples=_sample_lines(log["samples"], "greedy"),
        sampled=_sample_lines(log["samples"], "sampled"),
    )


def write_model_card(model_dir: Path, log: dict) -> None:
    """README.md (the card) and LICENSE (the PSF License Agreement the corpus comes under)."""
    weights = model_dir / "model.safetensors"
    (model_dir / "README.md").write_text(render(log, weights.stat().st_size), encoding="utf-8")
    shutil.copy(CORPUS_DIR / "LICENSE-PSF.txt", model_dir / "LICENSE")


if __name__ == "__main__":
    model_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "tinyvllm" / "models" / "demo"
    write_model_card(model_dir, json.loads((model_dir / "training_log.json").read_text()))
    print(model_dir / "README.md")
