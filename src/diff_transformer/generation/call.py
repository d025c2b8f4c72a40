"""What `diff-transformer generate` (whose command is `cli/generate.py`) hands to transformers' `generate`: the prompt
(`prompt_inputs`: PROMPT through the tokenizer or the chat template, `chat_inputs`, checked against the model's
vocabulary and context before the weights load), the keywords of a call (`generate_kwargs`: sampling, NaN logits
refused by `FiniteLogits`, generation_config.json's fields checked; --compile's static cache and compiled decoding
step, `compile_kwargs`), and the interactive chat, its history kept within the context (`chat_session`)."""

from . import GenerationError


def _processor_base():
    from transformers import LogitsProcessor

    return LogitsProcessor


class FiniteLogits(_processor_base()):
    """A logits processor (last in `generate`'s list, after temperature, top-k and top-p, which only set -inf) that
    raises `GenerationError` when a row of scores holds NaN or +inf, or no finite score at all: sampling or argmax
    would then pick token 0 or fail deep in torch, an empty or all-token-0 answer with exit 0. Such numbers come from
    values that overflow: an adapter's `lora_alpha` (W + (alpha / r)·B·A), float16 weights out of range, a config
    value outside what the model computes in."""

    def __init__(self, model_name: str):
        self.model_name, self.step = model_name, 0

    def __call__(self, input_ids, scores):
        import torch

        self.step += 1
        bad = torch.isnan(scores).any() or torch.isposinf(scores).any() or not torch.isfinite(scores).any(-1).all()
        if bad:
            raise GenerationError(
                f"MODEL {self.model_name} gave non-finite logits (NaN or inf) for generated token {self.step}: its "
                "weights or config overflow (an adapter's lora_alpha, float16 weights out of range, a config value): "
                "check them, or load it with --dtype float32."
            )
        return scores


def prompt_inputs(
    tokenizer,
    text_config,
    location: str,
    *,
    name: str,
    prompt: str | None,
    system: str | None = None,
    chat: bool = False,
    max_new_tokens: int,
) -> dict:
    """The inputs of `generate` for PROMPT, checked before the weights load: through the chat template (CHAT, with
    SYSTEM; PROMPT None: an interactive chat, whose template is tried on a first message), the tokenizer, or PROMPT's
    own token ids when the model has no tokenizer (TOKENIZER None); the ids within TEXT_CONFIG's vocabulary, the
    prompt and MAX_NEW_TOKENS within its context, and the token ids of LOCATION's generation_config.json within the
    vocabulary. NAME: the model as the user named it."""
    import torch

    from .config import check_generation_tokens

    if chat:
        inputs = chat_inputs(tokenizer, "Hello." if prompt is None else prompt, system, name)
        ids = inputs["input_ids"][0].tolist()
    elif tokenizer is not None:
        inputs = tokenizer(prompt, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
    else:
        try:
            ids = [int(t) for t in prompt.split()]
        except ValueError:
            raise GenerationError(
                f"MODEL {name} has no tokenizer, so PROMPT must be space-separated token ids like '5 6 7', not "
                f"{prompt!r}: pass token ids, or save a tokenizer with the model."
            ) from None
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if not ids:
        raise GenerationError("PROMPT is empty: pass some text (or token ids).")
    vocab = text_config.vocab_size
    check_generation_tokens(location, f"MODEL {name}", vocab)
    _check_length(len(ids), max_new_tokens, text_config, name)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise GenerationError(
            f"token id {bad[0]} in PROMPT is out of range for MODEL {name}: use ids from 0 to {vocab - 1}."
        )
    return inputs


def _check_length(prompt_tokens: int, max_new_tokens: int, config, name: str) -> None:
    """PROMPT + --max-new-tokens within the model's context: beyond it the positions were never trained, and the
    cache (memory) grows with whatever number is asked."""
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and prompt_tokens >= context:
        raise GenerationError(
            f"PROMPT has {prompt_tokens} tokens, MODEL {name}'s context {context} positions: shorten it."
        )
    if context is not None and prompt_tokens + max_new_tokens > context:
        raise GenerationError(
            f"PROMPT ({prompt_tokens} tokens) + --max-new-tokens {max_new_tokens} exceeds MODEL {name}'s "
            f"context ({context} positions): lower --max-new-tokens to at most {context - prompt_tokens}."
        )


def generate_kwargs(
    model,
    tokenizer,
    name: str,
    *,
    max_new_tokens: int,
    temperature: float,
    repetition_penalty: float | None,
    top_p: float | None,
    top_k: int | None,
    compile_device: str | None = None,
) -> dict:
    """The keywords of `model.generate` for generate's options (COMPILE_DEVICE: --compile's device, else None), NaN
    logits refused with one line (`FiniteLogits`); generation_config.json's fields that need what the model lacks (a
    tokenizer, an eos_token_id) refused first. NAME: the model as the user named it."""
    from transformers import LogitsProcessorList

    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0)
    kwargs["logits_processor"] = LogitsProcessorList([FiniteLogits(name)])  # NaN logits: one line, exit 2
    kwargs["return_dict_in_generate"] = False  # the token ids, whatever generation_config.json says
    generation = model.generation_config.to_dict() if getattr(model, "generation_config", None) else {}
    needs_tokenizer = [field for field in ("stop_strings", "token_healing") if generation.get(field)]
    if needs_tokenizer and tokenizer is None:
        raise GenerationError(
            f"MODEL {name}'s generation_config.json sets {needs_tokenizer[0]}, which needs a tokenizer, and the "
            "model has none: remove the field, or save a tokenizer with the model."
        )
    if needs_tokenizer:
        kwargs["tokenizer"] = tokenizer  # generate() matches stop strings and heals tokens with it
    if generation.get("exponential_decay_length_penalty") and generation.get("eos_token_id") is None:
        raise GenerationError(
            f"MODEL {name}'s generation_config.json sets exponential_decay_length_penalty, which raises the "
            "end-of-sequence token's score, but no eos_token_id: add it, or remove the field."
        )
    if temperature > 0:
        kwargs["temperature"] = temperature
    if repetition_penalty is not None:
        kwargs["repetition_penalty"] = repetition_penalty
    kwargs.update({key: value for key, value in (("top_p", top_p), ("top_k", top_k)) if value is not None})
    if compile_device is not None:
        kwargs.update(compile_kwargs(compile_device))
    return kwargs


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


def chat_inputs(tokenizer, prompt: str, system: str | None, name: str):
    """PROMPT (and --system, SYSTEM) as a chat, through the tokenizer's chat template, ending with the assistant's
    turn; NAME: the model as the user named it."""
    from .chat_templates import ChatRenderError, render_chat

    if tokenizer is None:
        raise GenerationError(f"--chat needs a tokenizer with a chat template, and MODEL {name} has no tokenizer.")
    if not getattr(tokenizer, "chat_template", None):
        raise GenerationError(
            f"--chat: the tokenizer of MODEL {name} has no chat template: drop --chat for plain completion, "
            "or save a chat_template.jinja with the tokenizer."
        )
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    try:
        text = render_chat(tokenizer, messages, add_generation_prompt=True)
    except ChatRenderError as exc:  # one line: the request's size, a bound, or the template's own error
        raise GenerationError(
            f"--chat: MODEL {name}: {exc}" + ("; try without --system." if system else ".")
        ) from None
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")  # the template placed the special tokens


def chat_session(
    model, tokenizer, kwargs: dict, config, device, *, name: str, system: str | None, max_new_tokens: int
) -> int:
    """`generate MODEL --chat` without PROMPT (MODEL: NAME): messages read from stdin one per line, each answer
    streamed to stdout with the model loaded once; the history (and --system, SYSTEM) goes into each prompt, its
    oldest exchanges dropped when it would not leave --max-new-tokens (MAX_NEW_TOKENS) of the context; /reset clears
    it, /exit or end of input ends."""
    import sys

    import torch
    from transformers import TextStreamer

    from ..text_input import TextInputError, check_text
    from .chat_templates import ChatRenderError, render_chat

    def note(text: str, end: str = "\n") -> None:
        print(text, end=end, file=sys.stderr, flush=True)

    context = getattr(config, "max_position_embeddings", None)
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)

    def prompt_ids(messages):
        text = render_chat(tokenizer, messages, add_generation_prompt=True)  # a ChatRenderError: one turn refused
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def fits(ids) -> bool:
        return context is None or len(ids) + max_new_tokens <= context

    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 become lone surrogates, refused per message
        sys.stdin.reconfigure(errors="surrogateescape")
    note(f"chat with {name}: type a message, then Enter; /reset starts over, /exit or Ctrl-D ends.")
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
                    f"{max_new_tokens} exceed the model's context ({context} positions): send a shorter one."
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
