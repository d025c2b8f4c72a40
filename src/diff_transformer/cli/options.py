"""Options that several commands share, and what they set up around a command's run."""

import contextlib
import sys
import warnings


QUIET_HELP = "no progress bars, and no warnings from transformers, PEFT or tokenizers: results and errors only"


def add_base_option(parser) -> None:
    parser.add_argument(
        "--base",
        help="for a PEFT adapter MODEL: its base model (default: base_model_name_or_path of adapter_config.json)",
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
            hf_logging.set_verbosity_error()
            warnings.simplefilter("ignore")
        try:
            yield progress
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
            if hub_bars:
                enable_progress_bars()
