"""`diff-transformer generate MODEL PROMPT`: text (or a chat turn) from a saved model or LoRA adapter, every input
checked before the weights load."""

import math

from ..checkpoints.backends import add_attn_option
from ..checkpoints.configs import MIN_TEMPERATURE
from ..errors import UserError, check_seed
from .options import (
    add_base_option,
    add_device_options,
    add_quiet_option,
    load_kwargs,
    resolve_device,
)


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
        "first tokens wait for the compile (about a minute), long answers come faster",
    )
    add_device_options(generate, "generate")
    add_attn_option(generate)
    add_base_option(generate)
    add_quiet_option(generate)
    generate.set_defaults(func=run)


def run(args) -> int:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from ..checkpoints import adapters
    from ..checkpoints.configs import check_generation_config, check_generation_tokens, float_generation_fields
    from ..checkpoints.loading import check_diff_checkpoint
    from ..text_input import check_text

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
    _check_generate_options(args)
    for name, text in (("PROMPT", args.prompt), ("--system", args.system)):
        if text is not None:  # argv undecodable as UTF-8 arrives with lone surrogates
            check_text(text, name)
    device = resolve_device(args.device)
    if args.compile:
        _check_compile(args, device)
    # Everything about the inputs is checked before the weights load.
    source = adapters.resolve(args.model, args.base)
    if source.local is not None:
        check_diff_checkpoint(source.local)
    check_generation_config(source.location, f"MODEL {args.model}")
    tokenizer = adapters.load_tokenizer(AutoTokenizer, source.tokenizer, source.tokenizer_local, args.model)
    session = args.prompt is None  # an interactive chat: its template checked on a first message
    if session and not args.chat:
        raise UserError("PROMPT is missing: pass one, or add --chat without PROMPT for an interactive chat.")
    if args.chat:
        inputs = _chat_inputs(args, tokenizer, "Hello." if session else args.prompt)
        ids = inputs["input_ids"][0].tolist()
    elif tokenizer is not None:
        inputs = tokenizer(args.prompt, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
    else:
        try:
            ids = [int(t) for t in args.prompt.split()]
        except ValueError:
            raise UserError(
                f"MODEL {args.model} has no tokenizer, so PROMPT must be space-separated token ids like '5 6 7', not "
                f"{args.prompt!r}: pass token ids, or save a tokenizer with the model."
            ) from None
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if not ids:
        raise UserError("PROMPT is empty: pass some text (or token ids).")
    try:
        text_config = AutoConfig.from_pretrained(source.location).get_text_config()
        vocab = text_config.vocab_size
    except Exception as exc:
        raise UserError(
            f"cannot read the config of MODEL {args.model} ({' '.join(str(exc).split())[:200]})."
        ) from None
    check_generation_tokens(source.location, f"MODEL {args.model}", vocab)
    _check_generation_length(args, len(ids), text_config)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UserError(
            f"token id {bad[0]} in PROMPT is out of range for MODEL {args.model}: use ids from 0 to {vocab - 1}."
        )
    if args.stream and tokenizer is None:
        raise UserError(f"--stream prints text, and MODEL {args.model} has no tokenizer: drop --stream.")
    model = adapters.load(source, **load_kwargs(args.dtype, args.attn_implementation)).eval().to(device)
    if getattr(model, "generation_config", None) is not None:
        float_generation_fields(model.generation_config)  # "repetition_penalty": 2 is the float 2.0
    inputs = {name: value.to(device) for name, value in inputs.items()}
    from transformers import LogitsProcessorList

    from ..checkpoints.finite import FiniteLogits

    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    kwargs["logits_processor"] = LogitsProcessorList([FiniteLogits(args.model)])  # NaN logits: one line, exit 2
    kwargs["return_dict_in_generate"] = False  # the token ids, whatever generation_config.json says
    generation = model.generation_config.to_dict() if getattr(model, "generation_config", None) else {}
    needs_tokenizer = [name for name in ("stop_strings", "token_healing") if generation.get(name)]
    if needs_tokenizer and tokenizer is None:
        raise UserError(
            f"MODEL {args.model}'s generation_config.json sets {needs_tokenizer[0]}, which needs a tokenizer, and the "
            "model has none: remove the field, or save a tokenizer with the model."
        )
    if needs_tokenizer:
        kwargs["tokenizer"] = tokenizer  # generate() matches stop strings and heals tokens with it
    if generation.get("exponential_decay_length_penalty") and generation.get("eos_token_id") is None:
        raise UserError(
            f"MODEL {args.model}'s generation_config.json sets exponential_decay_length_penalty, which raises the "
            "end-of-sequence token's score, but no eos_token_id: add it, or remove the field."
        )
    if args.temperature > 0:
        kwargs["temperature"] = args.temperature
    if args.repetition_penalty is not None:
        kwargs["repetition_penalty"] = args.repetition_penalty
    kwargs.update({name: getattr(args, name) for name in ("top_p", "top_k") if getattr(args, name) is not None})
    if args.compile:
        kwargs.update(compile_kwargs(device))
    if args.seed is not None:
        from transformers import set_seed

        set_seed(args.seed)  # the sampling draws (python, numpy and torch generators)
    if session:
        return _chat_session(args, model, tokenizer, kwargs, text_config, device)
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
    """The options `generate` has beyond the prompt and length: one line each when out of range."""
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


def compile_kwargs(device: str) -> dict:
    """`generate` keywords of --compile: a static cache, with which transformers compiles the decoding step (not the
    prefill) by `compile_config`. fullgraph: a graph break is an error, not a silent slowdown. On CUDA transformers'
    default mode, "reduce-overhead" (CUDA graphs); on the CPU inductor's default mode, and the flag that asks
    transformers to compile there (it compiles by itself on accelerators only)."""
    from transformers import CompileConfig

    if device.startswith("cuda"):
        return dict(cache_implementation="static", compile_config=CompileConfig(fullgraph=True))
    config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    # Relies on: `GenerationMixin._valid_auto_compile_criteria` compiling off accelerators when the compile config's
    # `_compile_all_devices` is set (transformers' own tests set it so). Guarded by
    # tests/model/test_generation.py::test_compiled_decoding_equals_eager (it checks the call was compiled).
    config._compile_all_devices = True
    return dict(cache_implementation="static", compile_config=config)


def _chat_inputs(args, tokenizer, prompt: str):
    """PROMPT (and --system) as a chat, through the tokenizer's chat template, ending with the assistant's turn."""
    from ..chat_templates import ChatRenderError, render_chat

    if tokenizer is None:
        raise UserError(f"--chat needs a tokenizer with a chat template, and MODEL {args.model} has no tokenizer.")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"--chat: the tokenizer of MODEL {args.model} has no chat template: drop --chat for plain completion, "
            "or save a chat_template.jinja with the tokenizer."
        )
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    try:
        text = render_chat(tokenizer, messages, add_generation_prompt=True)
    except ChatRenderError as exc:  # one line: the request's size, a bound, or the template's own error
        raise UserError(
            f"--chat: MODEL {args.model}: {exc}" + ("; try without --system." if args.system else ".")
        ) from None
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")  # the template placed the special tokens


def _chat_session(args, model, tokenizer, kwargs: dict, config, device) -> int:
    """`generate MODEL --chat` without PROMPT: messages read from stdin one per line, each answer streamed to stdout
    with the model loaded once; the history (and --system) goes into each prompt, its oldest exchanges dropped when
    it would not leave --max-new-tokens of the context; /reset clears it, /exit or end of input ends."""
    import sys

    import torch
    from transformers import TextStreamer

    from ..chat_templates import ChatRenderError, render_chat
    from ..text_input import TextInputError, check_text

    def note(text: str, end: str = "\n") -> None:
        print(text, end=end, file=sys.stderr, flush=True)

    context = getattr(config, "max_position_embeddings", None)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)

    def prompt_ids(messages):
        text = render_chat(tokenizer, messages, add_generation_prompt=True)  # a ChatRenderError: one turn refused
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def fits(ids) -> bool:
        return context is None or len(ids) + args.max_new_tokens <= context

    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 become lone surrogates, refused per message
        sys.stdin.reconfigure(errors="surrogateescape")
    note(f"chat with {args.model}: type a message, then Enter; /reset starts over, /exit or Ctrl-D ends.")
    while True:
        note("> ", end="")
        line = sys.stdin.readline()
        text = line.strip()
        if not line or text in ("/exit", "/quit"):
            # End the "> " line: at end of input nothing was typed after it; a terminal echoed the Enter of /exit
            # itself, piped input did not.
            if not line or not sys.stdin.isatty():
                note("")
            break
        if text == "/reset":
            history = list(start)
            note("(history cleared)")
            continue
        if not text:
            continue
        try:
            check_text(text, "this message")  # stdin that is not UTF-8 arrives with lone surrogates
        except TextInputError as error:
            note(f"error: {error}")  # the session goes on
            continue
        message = {"role": "user", "content": text}
        kept = list(history)
        try:
            alone = prompt_ids([*start, message])
            if not fits(alone):  # refused before the history is touched
                note(
                    f"error: this message ({len(alone)} tokens with the template) + --max-new-tokens "
                    f"{args.max_new_tokens} exceed the model's context ({context} positions): send a shorter one."
                )
                continue
            history.append(message)
            ids = prompt_ids(history)
            while not fits(ids):
                del history[len(start) : len(start) + 2]  # the oldest exchange: a user message and its answer
                note("(the oldest exchange was dropped to fit the model's context)")
                ids = prompt_ids(history)
        except ChatRenderError as error:  # this turn refused in one line; the session and its history go on
            history = kept
            note(f"error: {error}; this message was not sent.")
            continue
        input_ids = torch.tensor([ids], device=device)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        output = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer, **kwargs
        )
        history.append(
            {"role": "assistant", "content": tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True)}
        )
    return 0


def _check_generation_length(args, prompt_tokens: int, config) -> None:
    """PROMPT + --max-new-tokens within the model's context: beyond it the positions were never trained, and the
    cache (memory) grows with whatever number is asked."""
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and prompt_tokens >= context:
        raise UserError(
            f"PROMPT has {prompt_tokens} tokens, MODEL {args.model}'s context {context} positions: shorten it."
        )
    if context is not None and prompt_tokens + args.max_new_tokens > context:
        raise UserError(
            f"PROMPT ({prompt_tokens} tokens) + --max-new-tokens {args.max_new_tokens} exceeds MODEL {args.model}'s "
            f"context ({context} positions): lower --max-new-tokens to at most {context - prompt_tokens}."
        )
