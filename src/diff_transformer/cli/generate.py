"""`diff-transformer generate MODEL PROMPT`: text (or a chat turn) from a saved model or LoRA adapter, every input
checked before the weights load. The model opens through `checkpoints` (resolved and checked, then loaded with its
generation settings applied); the prompt and the call are `diff_transformer.generation`'s; this module parses and
prints."""

import math
import sys
import time

from ..checkpoints.backends import add_attn_option
from ..errors import UserError, check_seed
from ..generation.config import MIN_TEMPERATURE
from .options import add_base_option, add_device_options, add_quiet_option, load_kwargs, resolve_device


def add_parser(commands) -> None:
    generate = commands.add_parser("generate", help="generate text (or chat) with a saved Diff model or LoRA adapter")
    generate.add_argument(
        "model", help="model or LoRA adapter directory, or Hub id org/name (hf://name forces a Hub id)"
    )
    generate.add_argument(
        "prompt",
        nargs="?",
        help="text (or space-separated token ids if the model has no tokenizer); left out with --chat: an interactive "
        "chat (streamed answers, the history kept within the context, /reset, /exit)",
    )
    generate.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; sampling: at least 1e-4")
    generate.add_argument("--chat", action="store_true", help="PROMPT is a user message: apply the chat template")
    generate.add_argument("--system", help="system message of --chat (default: none)")
    generate.add_argument("--repetition-penalty", type=float, default=None, help="default: the model's (1 = none)")
    generate.add_argument(
        "--seed", type=int, default=None, help="seed of the sampling, --temperature > 0 (default: none, a fresh draw)"
    )
    generate.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling: the smallest set of tokens of this mass, (0, 1] (default: none)",
    )
    generate.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely tokens, k >= 1 (default: none)"
    )
    generate.add_argument(
        "--stream", action="store_true", help="print the answer token by token as it is generated (needs a tokenizer)"
    )
    generate.add_argument(
        "--compile",
        action="store_true",
        help="decode with a static cache and a torch.compile'd decoding step (fullgraph; CUDA graphs on a GPU): the "
        "first tokens wait for the compile (on 2 CPU cores 2-5 min of the first call, up to 14 min wall under load; "
        "docs/performance.md), long answers come faster",
    )
    add_device_options(generate, "generate")
    add_attn_option(generate)
    add_base_option(generate)
    add_quiet_option(generate)
    generate.set_defaults(func=run, early_check=_check_generate_options)


def run(args) -> int:
    from ..checkpoints.opening import open_checkpoint
    from ..generation.call import chat_session, generate_kwargs, prompt_inputs
    from ..text_input import check_text

    _check_generate_options(args)
    for name, text in (("PROMPT", args.prompt), ("--system", args.system)):
        if text is not None:  # argv undecodable as UTF-8 arrives with lone surrogates
            check_text(text, name)
    device, load = resolve_device(args.device), load_kwargs(args.dtype, args.attn_implementation)
    if args.compile:
        _check_compile(args, device)
    session = args.prompt is None  # an interactive chat: its template checked on a first message
    # Everything about the inputs is checked before the weights load.
    checkpoint = open_checkpoint(args.model, args.base)
    tokenizer, text_config = checkpoint.tokenizer, checkpoint.text_config
    inputs = prompt_inputs(
        tokenizer,
        text_config,
        checkpoint.location,
        name=args.model,
        prompt=args.prompt,
        system=args.system,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens,
    )
    if args.stream and tokenizer is None:
        raise UserError(f"--stream prints text, and MODEL {args.model} has no tokenizer: drop --stream.")
    model = checkpoint.load(**load).eval().to(device)
    inputs = {name: value.to(device) for name, value in inputs.items()}
    options = {name: getattr(args, name) for name in ("temperature", "repetition_penalty", "top_p", "top_k")}
    compile_device = device if args.compile else None
    kwargs = generate_kwargs(
        model, tokenizer, args.model, max_new_tokens=args.max_new_tokens, compile_device=compile_device, **options
    )
    if args.seed is not None:
        from transformers import set_seed

        set_seed(args.seed)  # the sampling draws (python, numpy and torch generators)
    if session:
        return chat_session(
            model,
            tokenizer,
            kwargs,
            text_config,
            device,
            name=args.model,
            system=args.system,
            max_new_tokens=args.max_new_tokens,
        )
    compiling = _compile_note(args, device)
    started = time.perf_counter()
    status = _answer(args, model, tokenizer, inputs, kwargs)
    if compiling:
        print(
            f"note: {compiling} done: generation took {time.perf_counter() - started:.0f} s with it", file=sys.stderr
        )
    return status


def _compile_note(args, device: str) -> str | None:
    """What this run compiles before its first tokens (--compile; flex attention on the CPU, which compiles C++), said
    in one line on stderr as it starts (unless --quiet): minutes on a CPU, without a word otherwise."""
    if args.compile:
        what = "compiling the decoding step (torch.compile, fullgraph)"
    elif args.attn_implementation == "flex_attention" and device == "cpu":
        what = "compiling flex attention's C++ kernels for the CPU"
    else:
        return None
    if not args.quiet:
        print(
            f"note: {what}: the first tokens wait for it (minutes on a CPU: 155-280 s of the first call on 2 cores, "
            "docs/performance.md)",
            file=sys.stderr,
            flush=True,
        )
    return None if args.quiet else what


def _answer(args, model, tokenizer, inputs: dict, kwargs: dict) -> int:
    """The answer printed: streamed (--stream), else at once, as text or (no tokenizer) token ids."""
    if args.stream:  # TextStreamer prints each piece of text as it is decoded, and a newline at the end
        from transformers import TextStreamer

        model.generate(
            **inputs, **kwargs, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        )
        return 0
    output = model.generate(**inputs, **kwargs)[0, inputs["input_ids"].shape[1] :]
    print(
        tokenizer.decode(output, skip_special_tokens=True)
        if tokenizer is not None
        else " ".join(map(str, output.tolist()))
    )
    return 0


def _check_generate_options(args) -> None:
    """The options of `generate`: one line each when out of range."""
    if args.prompt is None and not args.chat:
        raise UserError("PROMPT is missing: pass one, or add --chat without PROMPT for an interactive chat.")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} must be at least 1.")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature {args.temperature} must be a number >= 0 (0 = greedy).")
    if 0 < args.temperature < MIN_TEMPERATURE:  # the logits / temperature overflow: NaN probabilities
        raise UserError(
            f"--temperature {args.temperature:g} is below {MIN_TEMPERATURE:g}, where sampling's probabilities "
            f"overflow to NaN: pass 0 for greedy decoding (what such a temperature amounts to), or a temperature >= "
            f"{MIN_TEMPERATURE:g}."
        )
    if args.repetition_penalty is not None and not (
        math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0
    ):
        raise UserError(f"--repetition-penalty {args.repetition_penalty} must be a number > 0 (1 = none).")
    if args.top_p is not None and not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise UserError(f"--top-p {args.top_p} must be a number in (0, 1] (1 = no nucleus cut).")
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k {args.top_k} must be at least 1.")
    if (args.top_p is not None or args.top_k is not None) and args.temperature == 0:
        raise UserError("--top-p / --top-k shape sampling: add --temperature > 0 (0 is greedy, which ignores them).")
    if args.system is not None and not args.chat:
        raise UserError("--system is the system message of a chat: add --chat.")
    if args.seed is not None:
        check_seed(args.seed, "--seed")


def _check_compile(args, device: str) -> None:
    """--compile where it works: transformers compiles `generate`'s decoding step on CUDA (and, told to, on the CPU),
    for the shapes of one call."""
    if args.chat and args.prompt is None:
        raise UserError(
            "--compile compiles the decoding step for one prompt's cache length, and an interactive chat's prompt "
            "grows every turn (a compile per message): pass a PROMPT, or drop --compile."
        )
    if device.startswith("mps"):
        raise UserError(
            "--compile: transformers compiles generate's decoding step on CUDA or the CPU, not on mps: add --device "
            "cpu, or drop --compile."
        )
