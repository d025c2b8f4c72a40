"""Options that keep `diff-transformer train` quiet, small and exact in tests (fp32 on a GPU too)."""

BLOCK = 32
QUIET = [
    "--quiet",
    "--report-to",
    "none",
    "--block-size",
    str(BLOCK),
    "--bf16",
    "off",
]  # exact comparisons on a GPU too


def train_argv(work, output, *extra):
    """`diff-transformer train` of the tiny Diff V2 checkpoint WORK/v2 on WORK/text.txt into OUTPUT (`train_work`)."""
    return ["train", work / "v2", "--data", work / "text.txt", "--output", output, *QUIET, *extra]


def train_work(root):
    """ROOT with what the --output tests (tests/outputs) run commands on: a tiny Diff V2 checkpoint (`v2`) and a text
    to train it on (`text.txt`), a tiny Llama to convert (`llama`) and a one-step LoRA run on `v2` to merge
    (`lora`)."""
    from diff_transformer import cli

    from .checkpoints import HELDOUT, make_llama, save_trainable_checkpoint

    save_trainable_checkpoint(root / "v2", 2)
    (root / "text.txt").write_text(HELDOUT[:2500], encoding="utf-8")
    make_llama(root / "llama")
    lora = train_argv(root, root / "lora", "--max-steps", "1", "--lora", "--lora-r", "4")
    assert cli.main([str(a) for a in lora]) == 0
    return root
