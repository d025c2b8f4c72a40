"""Evaluation: held-out perplexity as the demo, `convert --verify` and scripts/train_tiny_llama.py score it (here),
and the needle-in-a-haystack test of `diff-transformer niah` (`niah.py`)."""

import math


EVAL_BLOCK_SIZE = 256  # tokens per perplexity window, the leading <s> included (as in training)
HELDOUT_TOKENS = 16 * (EVAL_BLOCK_SIZE - 1)  # the held-out slice the demo and `convert --verify` score: 16 windows
HELDOUT_TEXT = "the shipped held-out Austen text"  # assets/heldout.txt, as the printed perplexities name it


def heldout_description(tokens: int, block_size: int = EVAL_BLOCK_SIZE) -> str:
    """How a printed perplexity names what it scored: "the shipped held-out Austen text (4,080 tokens, 16
    windows of 256)" (the last window shorter when `tokens` is not a multiple of `block_size - 1`)."""
    windows = -(-tokens // (block_size - 1))
    return f"{HELDOUT_TEXT} ({tokens:,} tokens, {windows} windows of {block_size})"


def format_perplexity(value: float, decimals: int = 3) -> str:
    """A perplexity as printed: DECIMALS places below 1e6, then 4 significant digits ("1.014e+304", not the 305
    digits of a diverged run's), "inf" past float's range."""
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{decimals}f}" if value < 1e6 else f"{value:.3e}"


def heldout_perplexity(
    model,
    tokenizer,
    text: str,
    *,
    block_size: int = EVAL_BLOCK_SIZE,
    max_tokens: int | None = None,
    batch_size: int = 16,
    return_logits: bool = False,
    progress: bool = False,
    desc: str = "perplexity",
):
    """Perplexity of `model` on `text`: the text's tokens (`max_tokens` first ones if given) are cut into consecutive
    windows of `block_size - 1` tokens, each scored after a leading bos token; exp(mean negative log-likelihood) over
    every token of the text. With `return_logits`, also returns the list of logits tensors (for comparisons); with
    `progress`, the windows scored so far (`progress.Progress`: a bar on a terminal, lines in a log)."""
    import torch  # here, not at the top: the command line imports this module for its help

    ids = tokenizer(text, add_special_tokens=False, verbose=False).input_ids
    if max_tokens is not None:
        ids = ids[:max_tokens]
    span = block_size - 1
    windows = [ids[i : i + span] for i in range(0, len(ids), span)]
    if not windows:
        raise ValueError("no text to score")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count, all_logits = 0.0, 0, []
    try:
        with torch.no_grad():
            # Full windows in batches, then the (shorter) last one alone: no padding anywhere.
            groups = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
            groups = [[w for w in g if len(w) == span] for g in groups] + [[w] for w in windows if len(w) != span]
            from ..progress import Progress

            bar = Progress(desc, total=len(windows), unit="window", enabled=progress)
            for group in (g for g in groups if g):
                batch = torch.tensor([[tokenizer.bos_token_id] + w for w in group], device=device)
                logits = model(input_ids=batch).logits.float()
                nll = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
                )
                total += nll.double().item()
                count += batch[:, 1:].numel()
                if return_logits:
                    all_logits.append(logits.cpu())
                bar.update(len(group))
            bar.close()
    finally:
        model.train(was_training)
    ppl = math.exp(total / count)
    return (ppl, all_logits) if return_logits else ppl
