"""Options that several commands share, what they set up around a command's run, and the help's format."""

import argparse
import contextlib
import sys
import warnings

from ..checkpoints.backends import resolve_device  # noqa: F401  (the --device check, with its options here)


QUIET_HELP = "no progress bars, and no warnings from transformers, PEFT or tokenizers: results and errors only"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default: "(default: X)" added where the help does not already say it. An
    option whose default is None says in its own help what happens without it; flags (off unless given) need not."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text.lower()
            or not action.option_strings
            or action.required
            or action.default in (None, argparse.SUPPRESS)
            or action.nargs == 0  # store_true/store_false/count flags and help/version actions
        ):
            return text
        return f"{text} (default: %(default)s)"


def options_without_default(parser) -> list[str]:
    """The options of PARSER whose help says no default (what `DefaultsHelpFormatter` cannot add: a None default,
    or no help at all, which argparse then does not format). Required options, and those of a required group of
    alternatives (train's --data / --chat-data), have none to say."""
    formatter = DefaultsHelpFormatter("x")
    chosen = {id(a) for group in parser._mutually_exclusive_groups if group.required for a in group._group_actions}
    return [
        action.option_strings[-1]
        for action in parser._actions
        if action.option_strings
        and not action.required
        and id(action) not in chosen
        and action.nargs != 0
        and action.help is not argparse.SUPPRESS
        and (not action.help or "default" not in formatter._get_help_string(action).lower())
    ]


def add_base_option(parser) -> None:
    parser.add_argument(
        "--base",
        help="for a PEFT adapter MODEL: its base model (default: the adapter's base_model.json, else "
        "base_model_name_or_path of adapter_config.json)",
    )


def add_quiet_option(parser) -> None:
    parser.add_argument("--quiet", action="store_true", help=QUIET_HELP)


def show_progress(quiet: bool = False) -> bool:
    """Progress bars only on a terminal: none under --quiet, none in a piped or redirected log."""
    return not quiet and sys.stderr.isatty()


@contextlib.contextmanager
def output_settings(quiet: bool = False):
    """Around a command: transformers' and huggingface_hub's progress bars (loading weights, downloads) off unless
    `show_progress` (the commands' own bars and Trainer's follow `show_progress` too), and under `quiet`
    transformers' logging (`generation flags are not valid`, tokenizer lengths, ...) and Python warnings (PEFT,
    torch). Everything is restored afterwards (the command also runs in-process, from tests and scripts)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    progress = show_progress(quiet)
    verbosity, bars, hub_bars = (
        hf_logging.get_verbosity(),
        hf_logging.is_progress_bar_enabled(),
        not are_progress_bars_disabled(),
    )
    with warnings.catch_warnings():
        if not progress:
            hf_logging.disable_progress_bar()
            disable_progress_bars()
        if quiet:
            from ..checkpoints.adapters import hide_bitsandbytes_kernel_notice

            hf_logging.set_verbosity_error()
            warnings.simplefilter("ignore")
            hide_bitsandbytes_kernel_notice()  # bitsandbytes' own logger: neither of the above reaches it
        try:
            yield progress
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
            if hub_bars:
                enable_progress_bars()


# ---- --device and --dtype (generate, inspect, merge; niah imports resolve_device) ----

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_device_options(parser, what: str = "run the model") -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help=f"where to {what}: auto (CUDA if present, else MPS, else CPU), cpu, cuda, cuda:N or mps (default: auto)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="load the weights in this dtype; auto keeps the dtype they were saved in (default: auto)",
    )


def load_kwargs(dtype: str | None, attn_implementation: str | None = None) -> dict:
    """`from_pretrained` keyword arguments of --dtype ("auto" or None: the dtype the weights were saved in) and
    --attn-implementation (None: transformers' choice)."""
    import torch

    kwargs = {"dtype": "auto" if dtype in (None, "auto") else getattr(torch, dtype)}
    if attn_implementation is not None:  # checked once before the command ran (`cli.main`)
        kwargs["attn_implementation"] = attn_implementation
    return kwargs
