"""The one chat-template renderer of the package, and its bounds. A chat template is code that comes with a model
(chat_template.jinja, or tokenizer_config.json's `chat_template`), and transformers renders it in jinja2's sandbox,
which stops a template from reaching Python's internals but not from computing without end: two nested
`range(10**5)` loops, a string doubled forty times, `"x" * 10**10`. Every command renders through here: `render_chat`
(train --chat-data, niah, generate --chat and its interactive session) and, in serve, transformers'
`apply_chat_template` once `bound_chat_templates` has run. Every render stays within:

* `MAX_INPUT_CHARS` characters of what the template is given (the text of the messages, tools, documents and other
  values, each message and list item counted as 16 more; media such as a base64 image not counted; checked before
  it runs): a larger request is refused as the request's size, not the template's fault,
* `RENDER_SECONDS` of wall-clock time and `RENDER_STEPS` Python line events (the template's code and the Python
  functions it calls, counted by a trace function in the rendering thread),
* `RENDER_CHARS` characters of output, and of any one string or list it builds (`*`, `+`, `~`, `%`, `**`,
  `join`, `replace`, `center`, `format`, ... are checked before they run),
* jinja2's own `range()` limit (`jinja2.sandbox.MAX_RANGE`, 100,000 items).

Refusals are one line, all `ChatRenderError`s: `ChatInputTooLargeError` (the request), `ChatTemplateBoundError` (the
template went past a bound) and `ChatTemplateFailedError` (the template raised, e.g. its own `raise_exception`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
import os
import re
import sys
import time

from ..errors import UserError, one_line


RENDER_SECONDS = 2.0
# A forked render's (the CLI's) extra time per Mi characters it is given (`check_input`'s count), on top of
# RENDER_SECONDS: a long conversation on a loaded machine is not killed for its length, a hostile template on a short
# one still is at RENDER_SECONDS + FORK_KILL_MARGIN_S. A render of 1 Mi characters (500 turns of 2,000) took 0.07 s in
# process, 0.17 s forked, at load 16 on 2 cores: the allowance is ~25x that.
FORK_SECONDS_PER_MI_CHARS = 4.0
RENDER_STEPS = 5_000_000
RENDER_CHARS = 4 << 20  # 4 Mi characters: far more than any model's context holds as text
MAX_INPUT_CHARS = 1 << 20  # 1 Mi characters given to one render: a quarter of RENDER_CHARS, room for the markup
_CHECK_EVERY = 1000  # line events between two looks at the clock


class ChatRenderError(UserError):
    """A render refused: the request too large, the template past a bound, or the template's own error."""


class ChatInputTooLargeError(ChatRenderError):
    """What a template would be given (the messages and other values) is over `MAX_INPUT_CHARS`."""

    def __init__(self, size: int):
        super().__init__(
            f"the messages (with the tools and other values a chat template is given) come to more than "
            f"{MAX_INPUT_CHARS:,} characters, the limit of one chat render ({size:,} counted, 16 for each message "
            "or item): send a shorter conversation"
        )


class ChatTemplateFailedError(ChatRenderError):
    """The template raised while rendering (its own `raise_exception`, a missing key, a type error)."""

    def __init__(self, detail: str):
        super().__init__(f"the chat template refuses these messages ({detail})")


class ChatTemplateBoundError(ChatRenderError):
    """A chat template went past a bound while rendering (the message says which, and its value)."""

    def __init__(self, detail: str):
        super().__init__(
            f"the chat template went past a bound: {detail}: fix the template (chat_template.jinja, or "
            "tokenizer_config.json's chat_template)"
        )


def _too_big(what: str) -> ChatTemplateBoundError:
    return ChatTemplateBoundError(f"it would build {what} (the limit is {RENDER_CHARS:,} characters or items)")


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _check_size(size: int, what: str = "a value") -> None:
    if size > RENDER_CHARS:
        raise _too_big(f"{what} of {size:,} characters")


# A width or precision of a million or more, or one taken from an argument: `%1000000s`, `%*s`, `{:1000000}`, `{:{}}`.
_PRINTF_WIDTH = re.compile(r"%[-+ #0]*(?:\*|\d{7,}|\d*\.(?:\*|\d{7,}))")
_FORMAT_WIDTH = re.compile(r"\{[^{}]*:[^{}]*(?:\d{7,}|\{)")


def _check_format(spec, *, printf: bool = True, args=()) -> None:
    if not isinstance(spec, str):
        return
    if (_PRINTF_WIDTH if printf else _FORMAT_WIDTH).search(spec):
        if all(not isinstance(a, int) or abs(a) <= RENDER_CHARS for a in args) and not re.search(r"\d{7,}", spec):
            return  # a width from an argument, and no argument is that large
        raise ChatTemplateBoundError(
            f"it formats with a width of a million or more in {spec[:40]!r} (the limit is {RENDER_CHARS:,} characters)"
        )


def _check_int(value, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > RENDER_CHARS:
        raise ChatTemplateBoundError(f"it passes {value:,} to {what} (the limit is {RENDER_CHARS:,})")


def _check_binop(operator: str, left, right) -> None:
    """Before `left OPERATOR right` runs: its result stays within `RENDER_CHARS` (and `**` within 4096 bits)."""
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if _size(sequence) and isinstance(count, int):
                _check_size(_size(sequence) * max(count, 0), "a repeated value")
    elif operator == "+":
        _check_size(_size(left) + _size(right), "a sum")
    elif operator == "%" and isinstance(left, str):
        _check_format(left, args=right if isinstance(right, tuple) else (right,))
    elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
        base = abs(left)
        if base > 1 and right > 0 and right * math.log2(base) > 4096:
            raise ChatTemplateBoundError(
                f"it computes {left!r} ** {right!r}, a number of more than 4096 bits (the limit)"
            )


def _check_call(function, args, kwargs) -> None:
    """Before a method call or filter that can build a value much larger than its inputs: its size is bounded."""
    owner = getattr(function, "__self__", None)
    name = getattr(function, "__name__", "")
    numbers = [*args, *kwargs.values()]
    if isinstance(owner, str):
        if name in ("ljust", "rjust", "center", "zfill", "expandtabs"):
            for value in numbers:
                _check_int(value, f"str.{name}")
            if name == "expandtabs" and numbers and isinstance(numbers[0], int):
                _check_size(owner.count("\t") * numbers[0] + len(owner), "an expanded string")
        elif name in ("format", "format_map"):
            _check_format(
                owner, printf=False, args=[*numbers, *(a for d in numbers if isinstance(d, dict) for a in d.values())]
            )
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            count = owner.count(args[0]) if args[0] else len(owner) + 1
            _check_size(len(owner) + count * max(len(args[1]) - len(args[0]), 0), "a replaced string")
        elif name == "join" and args and isinstance(args[0], (list, tuple)):
            items = args[0]
            _check_size(sum(len(str(i)) for i in items) + len(owner) * max(len(items) - 1, 0), "a joined string")
        elif name in ("translate", "maketrans"):
            raise ChatTemplateBoundError(f"it calls str.{name}, which is not allowed in a chat template here")


def _passed_types():
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return (Environment, EvalContext, Context)


_PASSED: tuple = ()


def _bounded_filter(name: str, filter_):
    @functools.wraps(filter_)
    def bounded(*args, **kwargs):
        values = [a for a in args if not isinstance(a, _PASSED)]  # what pass_context/environment filters get
        for value in [*values[1:], *kwargs.values()]:
            _check_int(value, f"the {name} filter")
        if name == "format" and values:
            _check_format(values[0], args=[*values[1:], *kwargs.values()])
        elif name == "replace" and len(values) >= 3:
            _check_call(str(values[0]).replace, (str(values[1]), str(values[2])), {})
        elif name == "join" and values:
            # the items, materialized (a range, a generator) to be counted before they are joined
            items = list(values[0]) if not isinstance(values[0], (str, dict)) else values[0]
            _check_size(len(items), "a list")
            separator = values[1] if len(values) > 1 else kwargs.get("d", "")
            _check_call(str(separator).join, ([str(i) for i in items],), {})
            args = tuple(items if a is values[0] else a for a in args)
        result = filter_(*args, **kwargs)
        _check_size(_size(result), f"the {name} filter's result")
        return result

    return bounded


def _bounded_join(join):
    @functools.wraps(join)
    def bounded(seq):
        seq = list(seq)
        _check_size(sum(len(str(s)) for s in seq), "a concatenation (~)")
        return join(seq)

    return bounded


# The render kwargs' digest and text of a render done ahead (serve renders off the event loop, then transformers'
# handler renders again on it: the second render is then this text, `prerendered`).
_PRERENDERED: contextvars.ContextVar = contextvars.ContextVar("diff_transformer_prerendered", default=None)
_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("diff_transformer_capture", default=None)


# A render process's memory (a forked child's, serve's worker's): above what a worker holds after its imports, 128x
# the largest output allowed
WORKER_MEMORY_BYTES = 512 << 20
# The refusals a worker reports by name, their message whole (else "bound" or "failed" with a detail)
ERRORS = ("ChatInputTooLargeError", "ChatTemplateBoundError", "ChatTemplateFailedError", "ChatRenderError")


def text_of(answer: dict | None, limit_s: float = RENDER_SECONDS) -> str:
    """The text of a render's ANSWER (`answer_of`'s, across a pipe), or its refusal raised; None: the render
    process overran its time or died (its memory). Shared by the forked renders (the CLI's) and serve's render
    workers (`serving.render_pool`)."""
    if answer is None:
        raise ChatTemplateBoundError(
            f"rendering it took over {limit_s:.3g} s or more memory than "
            f"{WORKER_MEMORY_BYTES >> 20} MiB (the limits; a chat template renders in milliseconds)"
        )
    if "text" in answer:
        return answer["text"]
    if answer["error"] in ERRORS:  # the render process's own refusal, its message whole
        error = globals()[answer["error"]].__new__(globals()[answer["error"]])
        Exception.__init__(error, answer["message"])
        raise error
    error_class = ChatTemplateBoundError if answer["error"] == "bound" else ChatTemplateFailedError
    raise error_class(answer["message"])


def answer_of(render) -> dict:
    """`render()`'s text, or its failure, as the JSON-able answer `text_of` reads."""
    try:
        return {"text": render()}
    except ChatRenderError as error:
        return {"error": type(error).__name__, "message": str(error)}
    except RecursionError:
        return {"error": "bound", "message": "it recursed past Python's depth limit"}
    except MemoryError:  # past RLIMIT_AS: its message is empty
        limit = WORKER_MEMORY_BYTES >> 20
        return {"error": "bound", "message": f"it needed more than {limit} MiB of memory (the limit)"}
    except OverflowError as error:
        return {"error": "bound", "message": one_line(error)}
    except Exception as error:
        return {"error": "failed", "message": one_line(error)}


def _cap_memory() -> None:
    """RLIMIT_AS at what this process maps now plus WORKER_MEMORY_BYTES."""
    import resource

    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + WORKER_MEMORY_BYTES
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


# serve's worker-process renderer (`serving.render_pool.RenderPool.render`), `in_process`, or None: a forked child
_ISOLATED = None
FORK_KILL_MARGIN_S = 1.0  # past a forked render's own time bound: that bound answers first whenever Python runs
FORK_KILL_S = RENDER_SECONDS + FORK_KILL_MARGIN_S  # the kill of a forked render of a short conversation
_render_seconds = RENDER_SECONDS  # the time bound of `generate`: a forked child's own, for its size (`fork_seconds`)


def fork_seconds(size: int) -> float:
    """The time bound of a forked render given SIZE characters (`check_input`'s count): RENDER_SECONDS plus
    FORK_SECONDS_PER_MI_CHARS per Mi characters; the child is killed FORK_KILL_MARGIN_S after it."""
    return RENDER_SECONDS + FORK_SECONDS_PER_MI_CHARS * size / (1 << 20)


def isolate(renderer) -> None:
    """From now on a bounded template's `render` calls RENDERER(source, args, kwargs) for its text; it returns
    NotImplemented for a render it does not take, which then renders here (`in_process`: every render here). None:
    the default, a forked child where the platform forks (`render_in_fork`), else this process."""
    global _ISOLATED
    _ISOLATED = renderer


@contextlib.contextmanager
def isolation(renderer):
    """`isolate(RENDERER)` for the renders inside the block, the renderer before it after."""
    global _ISOLATED
    previous, _ISOLATED = _ISOLATED, renderer
    try:
        yield
    finally:
        _ISOLATED = previous


def in_process(source, args, kwargs):
    """The renderer for `isolate` that renders in this process (serve's render workers: already isolated)."""
    return NotImplemented


def render_in_fork(source: str, args: tuple, kwargs: dict):
    """SOURCE rendered with ARGS/KWARGS in a child of this process, for the CLI (issue 56 item 2). One C call can build
    gigabytes holding the GIL (`{{ [[0] * 4000000] * 4000000 }}`, `tojson(indent=...)`, `indent(...)`,
    `wordwrap(wrapstring=...)`), past every bound checked between Python steps. A forked child costs milliseconds
    (serve's worker processes cost seconds to start: they import torch; benchmarks/render_isolation.py measures
    both): it caps its address space (`RLIMIT_AS`: what it maps now plus `WORKER_MEMORY_BYTES`, so a
    builder past it fails with MemoryError), arms an alarm (its default action ends it), renders with the template
    this process compiled (the compile cache is inherited), and writes its answer as JSON to a pipe; this process
    waits at most `fork_seconds(size)` + `FORK_KILL_MARGIN_S` (the child's own time bound is `fork_seconds(size)`:
    both grow with the conversation, so a long one on a loaded machine is not killed for its length), then kills it.
    The same answer format and errors as the workers' (`answer_of`,
    `text_of`). Nothing is unpickled; the child ends with os._exit (no atexit handler, no buffer of ours flushed)."""
    import selectors
    import signal

    from transformers.utils import chat_template_utils

    global _render_seconds
    template = chat_template_utils._compile_jinja_template(source)
    limit_s = fork_seconds(check_input(args, kwargs))
    kill_s = limit_s + FORK_KILL_MARGIN_S
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing here may return into the caller's code
        status = 1
        try:
            os.close(read_end)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(math.ceil(kill_s) + 1)  # a backstop: the parent kills at kill_s
            _render_seconds = limit_s  # this child's own bound (a global of the child only)
            _cap_memory()
            answer = answer_of(lambda: "".join(template.generate(*args, **kwargs)))
            data = json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogatepass")
            view = memoryview(data)
            while view:
                view = view[os.write(write_end, view) :]
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    chunks, deadline, answer = [], time.monotonic() + kill_s, None
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(read_end, selectors.EVENT_READ)
            while (left := deadline - time.monotonic()) > 0 and selector.select(left):
                chunk = os.read(read_end, 1 << 20)
                if not chunk:  # the child is done (or died: then its answer is incomplete)
                    answer = json.loads(b"".join(chunks).decode("utf-8", "surrogatepass")) if chunks else None
                    break
                chunks.append(chunk)
    except ValueError:  # an answer cut short by the child's death
        answer = None
    finally:
        os.close(read_end)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    return text_of(answer, limit_s)


def _digest(source: str, kwargs) -> str:
    import hashlib

    text = json.dumps([source, kwargs], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


_FORK = render_in_fork if hasattr(os, "fork") else None  # else the bounds in this process only

_ITEM_CHARS = 16  # what one list item or dict entry counts for: a template's work grows with items, not only text
# Media a multimodal request holds (a base64 image): the template writes a placeholder for it, never its text.
_MEDIA_KEYS = frozenset({"image", "image_url", "url", "audio", "input_audio", "video", "path", "base64"})


def check_input(*values) -> int:
    """The size of what a render is given, or `ChatInputTooLargeError` when it is over `MAX_INPUT_CHARS`: the
    characters of its strings, and `_ITEM_CHARS` for each list item or dict entry (a template's steps and time grow
    with the number of messages). Walked without recursion, and only until the limit is passed, so a deep or huge
    request costs no more than that."""
    size, stack = 0, list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, (str, bytes)):
            size += len(value)
        elif isinstance(value, dict):
            size += _ITEM_CHARS * len(value)
            for key, item in value.items():
                stack.append(key)
                if key not in _MEDIA_KEYS:
                    stack.append(item)
        elif isinstance(value, (list, tuple)):
            size += _ITEM_CHARS * len(value)
            stack.extend(value)
        if size > MAX_INPUT_CHARS:
            raise ChatInputTooLargeError(size)
    return size


def _deadline_tracer(limit_s: float, steps: int):
    """A trace function that raises `ChatTemplateBoundError` once `limit_s` seconds or `steps` line events passed."""
    start = time.monotonic()
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        count += 1
        if count % _CHECK_EVERY == 0:
            if count > steps:
                raise ChatTemplateBoundError(
                    f"rendering it ran over {steps:,} steps (the limit; a chat template renders in milliseconds)"
                )
            if time.monotonic() - start > limit_s:
                raise ChatTemplateBoundError(
                    f"rendering it took over {limit_s:g} s (the limit; a chat template renders in milliseconds)"
                )
        return trace

    return trace


def _bounded_environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value):
            """str.format / format_map, which jinja2 wraps when the template reads them: the format checked first."""
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None

            def bounded(*args, **kwargs):
                _check_call(value, args, kwargs)
                return wrapped(*args, **kwargs)

            return bounded

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja2's signature)
            if isinstance(getattr(__obj, "__self__", None), str) and getattr(__obj, "__name__", "") == "join":
                if args and not isinstance(args[0], (list, tuple)):  # materialized, to be counted
                    args = (list(args[0]), *args[1:])
                    _check_size(len(args[0]), "a list")
            _check_call(__obj, args, kwargs)
            result = super().call(__context, __obj, *args, **kwargs)
            _check_size(_size(result), "a call's result")
            return result

    return BoundedSandbox


def _bounded_template_class():
    from jinja2 import Template

    class BoundedTemplate(Template):
        """`render` and `generate` within the bounds (see the module docstring)."""

        def render(self, *args, **kwargs):
            check_input(args, kwargs)
            ahead = _PRERENDERED.get()
            if ahead is not None or _CAPTURE.get() is not None:
                digest = _digest(getattr(self, "_diff_source", ""), [args, kwargs])
                if ahead is not None and ahead[0] == digest:
                    _PRERENDERED.set(None)
                    return ahead[1]
            text = NotImplemented
            renderer = _ISOLATED if _ISOLATED is not None else _FORK
            if renderer is not None and hasattr(self, "_diff_source"):
                text = renderer(self._diff_source, args, kwargs)
            if text is NotImplemented:
                text = "".join(self.generate(*args, **kwargs))
            if _CAPTURE.get() is not None:
                _CAPTURE.get().append((digest, text))
            return text

        def generate(self, *args, **kwargs):
            check_input(args, kwargs)
            previous = sys.gettrace()
            tracer = _deadline_tracer(_render_seconds, RENDER_STEPS)
            sys.settrace(tracer)
            try:
                size = 0
                for piece in Template.generate(self, *args, **kwargs):
                    size += len(piece)
                    _check_size(size, "an output")
                    # the trace function is the thread's while the generator runs, and off while the caller does
                    sys.settrace(previous)
                    yield piece
                    sys.settrace(tracer)
            finally:
                sys.settrace(previous)

    return BoundedTemplate


def bounded_template(template):
    """A transformers-compiled chat template (`_cached_compile_jinja_template`), compiled again in a bounded sandbox
    with the same globals, filters and extensions."""
    global _PASSED
    _PASSED = _passed_types()
    environment = template.environment
    environment.__class__ = _bounded_environment_class()
    environment.template_class = _bounded_template_class()
    environment.filters = {name: _bounded_filter(name, f) for name, f in environment.filters.items()}
    return environment


@functools.cache
def bound_chat_templates() -> None:
    """From now on every chat template transformers renders in this process is bounded (see the module docstring)."""
    from transformers.utils import chat_template_utils

    compile_ = chat_template_utils._cached_compile_jinja_template

    @functools.lru_cache
    def compile_bounded(chat_template):
        # transformers' environment (its globals, filters, extensions) from an empty template: compiling the real
        # one there would run its constant parts (`'x'|center(10**9)`) unbounded, at compile time
        environment = bounded_template(compile_(""))
        template = environment.from_string(chat_template)
        template._diff_source = chat_template
        namespace = template.root_render_func.__globals__
        for name in ("str_join", "markup_join"):
            if name in namespace:
                namespace[name] = _bounded_join(namespace[name])
        return template

    chat_template_utils._compile_jinja_template = compile_bounded


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool, **kwargs) -> str:
    """The text of `messages` through the tokenizer's chat template, within the bounds (see the module docstring):
    any failure is a one-line `ChatRenderError`, whichever command renders."""
    bound_chat_templates()
    check_input(messages, kwargs)  # before transformers copies the messages
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except ChatRenderError:
        raise
    except RecursionError:  # a template's recursive macro
        raise ChatTemplateBoundError("it recursed past Python's depth limit") from None
    except (OverflowError, MemoryError) as error:  # jinja2's MAX_RANGE, a number too large to convert
        raise ChatTemplateBoundError(one_line(error)) from None
    except Exception as error:  # jinja2's TemplateError (raise_exception), a KeyError, a TypeError in the template
        raise ChatTemplateFailedError(one_line(error)) from None


def render_capturing(apply, *args, **kwargs) -> tuple[str, str] | None:
    """`apply(*args, **kwargs)` (an `apply_chat_template(..., tokenize=False)`), and what its render was: (the digest
    of the template and its kwargs, the text), to hand to `prerendered` in the context that renders it again."""
    captured: list = []
    token = _CAPTURE.set(captured)
    try:
        apply(*args, **kwargs)
    finally:
        _CAPTURE.reset(token)
    return captured[-1] if captured else None


def prerendered(render: tuple[str, str]) -> None:
    """The next render in this context (asyncio task) of the template and kwargs `render_capturing` saw returns its
    text without running again (serve renders off the event loop, then transformers' handler renders on it)."""
    _PRERENDERED.set(render)


__all__ = [
    "MAX_INPUT_CHARS",
    "RENDER_CHARS",
    "RENDER_SECONDS",
    "FORK_SECONDS_PER_MI_CHARS",
    "fork_seconds",
    "RENDER_STEPS",
    "ChatInputTooLargeError",
    "ChatRenderError",
    "ChatTemplateBoundError",
    "ChatTemplateFailedError",
    "bound_chat_templates",
    "check_input",
    "in_process",
    "isolate",
    "render_in_fork",
    "prerendered",
    "render_capturing",
    "render_chat",
]
