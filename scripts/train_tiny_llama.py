"""Train the tiny Llama that `diff-transformer demo` converts (shipped in src/diff_transformer/assets/tiny-llama/).

    python scripts/train_tiny_llama.py --overwrite           # rewrites the shipped assets: ~5 min on 2 idle cores
                                                              # (500 steps of ~0.6 s), longer when they are shared
    python scripts/train_tiny_llama.py --output /tmp/tiny --steps 100

Data: data/corpus.txt (training) and data/heldout.txt (held out), four public-domain Jane Austen novels; see
data/README.md for their provenance. Steps, all seeded (a rerun on the same machine and torch build reproduces
model.safetensors bit for bit; other CPUs or torch builds may differ in the last digits):

1. a byte-level BPE tokenizer (Hugging Face `tokenizers`, GPT-2-style pre-tokenisation, `--vocab-size` entries
   including the special tokens `<s>` (bos), `</s>` (eos), `<pad>` and the chat roles `<|system|>`, `<|user|>`,
   `<|assistant|>`), saved as a transformers fast tokenizer that prepends `<s>` and carries a small chat template;
2. a `LlamaForCausalLM` (GQA, tied embeddings) trained with AdamW on random windows of `--block-size` tokens,
   each window starting with `<s>`; every book ends with `</s>`;
3. held-out perplexity (`diff_transformer.cli.demo.heldout_perplexity`, the demo's function) on data/heldout.txt,
   printed and written to the model card together with the figures of the run;
4. `save_pretrained`: config.json, model.safetensors (float32), tokenizer, generation_config.json, README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from diff_transformer.cli.demo import DEMO_EVAL_TOKENS, heldout_perplexity


REPO = Path(__file__).resolve().parent.parent
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=REPO / "data", help="holds corpus.txt and heldout.txt")
    p.add_argument("--output", type=Path, default=REPO / "src" / "diff_transformer" / "assets" / "tiny-llama")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    # tokenizer
    p.add_argument("--vocab-size", type=int, default=2048)
    # model
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=512)
    # optimisation
    p.add_argument("--block-size", type=int, default=256, help="tokens per training window, <s> included")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=100)
    return p.parse_args(argv)


def read_books(path: Path) -> list[str]:
    """The corpus files hold one paragraph a line and a blank line between books."""
    return [book.strip("\n") for book in path.read_text(encoding="utf-8").split("\n\n") if book.strip()]


def train_tokenizer(books: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((line + "\n" for book in books for line in book.split("\n")), trainer)
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
    )


def encode_books(tokenizer, books: list[str]) -> torch.Tensor:
    ids = []
    for book in books:
        ids.extend(tokenizer(book, add_special_tokens=False, verbose=False).input_ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def model_card(figures: dict, args) -> str:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings.pop("data_dir"), settings.pop("output"), settings.pop("overwrite")
    return f"""---
license: apache-2.0
language: en
library_name: transformers
pipeline_tag: text-generation
---
# tiny-llama (Jane Austen)

A {figures["parameters"] / 1e6:.2f} M-parameter `LlamaForCausalLM` ({args.layers} layers, hidden {args.hidden_size},
{args.heads} attention heads over {args.kv_heads} key/value heads, tied embeddings) with a \
{figures["vocab_size"]}-entry
byte-level BPE tokenizer, trained from scratch by `scripts/train_tiny_llama.py` of the diff-transformer repository
on four public-domain novels by Jane Austen (Pride and Prejudice, Sense and Sensibility, Northanger Abbey,
Persuasion; see `data/README.md` there for provenance). It exists so that the package's demo can convert a real,
trained Llama checkpoint with a real tokenizer into a Diff Transformer V2 checkpoint offline; it is not a useful
language model.

| figure | value |
| --- | --- |
| training tokens seen | {figures["tokens_seen"]:,} ({figures["epochs"]:.2f} epochs of {figures["train_tokens"]:,}) |
| held-out tokens (last two chapters of each book) | {figures["heldout_tokens"]:,} |
| held-out perplexity | {figures["heldout_perplexity"]:.2f} (uniform: {figures["vocab_size"]}) |
| held-out perplexity, first {DEMO_EVAL_TOKENS} tokens (what the demo measures) | \
{figures["demo_slice_perplexity"]:.2f} |
| final training loss | {figures["final_train_loss"]:.3f} |
| training time | {figures["train_seconds"]:.0f} s on {figures["threads"]} CPU threads (torch {torch.__version__}) |

Settings:

```json
{json.dumps(settings, indent=2)}
```
"""


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    train_books = read_books(args.data_dir / "corpus.txt")
    heldout_text = (args.data_dir / "heldout.txt").read_text(encoding="utf-8")
    tokenizer = train_tokenizer(train_books, args.vocab_size, args.max_position_embeddings)
    train_ids = encode_books(tokenizer, train_books)
    print(
        f"tokenizer: byte-level BPE, {len(tokenizer)} entries, trained in {time.perf_counter() - t_start:.1f} s; "
        f"training text {sum(map(len, train_books)):,} characters -> {len(train_ids):,} tokens"
    )

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: LlamaForCausalLM, {n_params:,} parameters ({args.layers} layers, hidden {args.hidden_size}, "
        f"{args.heads} heads / {args.kv_heads} KV heads, tied embeddings)"
    )

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(args.seed)
    span = args.block_size - 1
    bos = torch.full((args.batch_size, 1), tokenizer.bos_token_id, dtype=torch.long)
    offsets = torch.arange(span)

    print(f"training: {args.steps} steps x {args.batch_size} windows x {args.block_size} tokens, lr {args.lr}")
    t_train = time.perf_counter()
    model.train()
    running = None
    for step in range(args.steps):
        starts = torch.randint(0, len(train_ids) - span, (args.batch_size, 1), generator=generator)
        batch = torch.cat([bos, train_ids[starts + offsets]], dim=1)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            ppl = heldout_perplexity(
                model, tokenizer, heldout_text, block_size=args.block_size, max_tokens=DEMO_EVAL_TOKENS
            )
            model.train()
            print(
                f"  step {step + 1:5d}  train loss {running:.3f}  held-out ppl (first {DEMO_EVAL_TOKENS} tokens) "
                f"{ppl:8.2f}  {time.perf_counter() - t_train:6.0f} s",
                flush=True,
            )
    train_seconds = time.perf_counter() - t_train
    model.eval()

    heldout_tokens = len(tokenizer(heldout_text, add_special_tokens=False, verbose=False).input_ids)
    ppl = heldout_perplexity(model, tokenizer, heldout_text, block_size=args.block_size)
    demo_ppl = heldout_perplexity(
        model, tokenizer, heldout_text, block_size=args.block_size, max_tokens=DEMO_EVAL_TOKENS
    )
    figures = {
        "parameters": n_params,
        "vocab_size": len(tokenizer),
        "train_tokens": len(train_ids),
        "tokens_seen": args.steps * args.batch_size * span,
        "epochs": args.steps * args.batch_size * span / len(train_ids),
        "heldout_tokens": heldout_tokens,
        "heldout_perplexity": ppl,
        "demo_slice_perplexity": demo_ppl,
        "final_train_loss": running,
        "train_seconds": train_seconds,
        "threads": torch.get_num_threads(),
    }
    print(
        f"held-out perplexity: {ppl:.2f} over {heldout_tokens:,} tokens (uniform would be {len(tokenizer)}); "
        f"first {DEMO_EVAL_TOKENS} tokens: {demo_ppl:.2f}"
    )

    out = args.output
    if out.exists() and any(out.iterdir()):
        if not args.overwrite:
            raise SystemExit(f"{out} is not empty: pass --overwrite to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=40,
        repetition_penalty=1.3,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(model_card(figures, args), encoding="utf-8")

    prompt = "It is a truth universally acknowledged"
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        sample = model.generate(**inputs)
    print(f"sample (greedy): {tokenizer.decode(sample[0], skip_special_tokens=True)!r}")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"saved to {out} ({size / 1e6:.2f} MB) in {time.perf_counter() - t_start:.0f} s total")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
