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
