"""The attention backend a command loads a model with (`--attn-implementation` of generate, inspect, niah and train,
and the one `serve` passes to transformers' server): the names transformers knows here, the package's among them,
checked once, before anything loads (`cli.main`); and the device a command runs on (`resolve_device`: `--device`
of generate, inspect, merge, niah, and convert's check)."""

# The names `attention_backends()` finds once transformers is imported (its AttentionInterface and the package's),
# known here without importing it, so that a mistyped name is refused before torch loads (`check_attn_name`).
# tests/cli/test_option_values.py holds it against `attention_backends()` of the installed transformers.
KNOWN_BACKENDS = (
    "diff_map_first",
    "diff_triton",
    "eager",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "flex_attention",
    "sdpa",
)

FLASH_AVAILABLE = {  # transformers' flash backends -> the check of their package
    "flash_attention_2": "is_flash_attn_2_available",
    "flash_attention_3": "is_flash_attn_3_available",
    "flash_attention_4": "is_flash_attn_4_available",
}


def add_attn_option(parser) -> None:
    parser.add_argument(
        "--attn-implementation",
        metavar="NAME",
        default=None,
        help="the attention backend: sdpa, eager (the only one returning maps), flex_attention, "
        "flash_attention_2/3/4, diff_triton (V1's fused kernel on CUDA), diff_map_first (V2's map formed first on "
        "CPU, last bits differ) (default: transformers' choice, sdpa)",
    )


def requested_attn_implementation(args) -> str | None:
    """The backend a command's arguments name: its --attn-implementation, or for `serve` the one it passes on to
    transformers' server (`--attn-implementation X`, `--attn-implementation=X`, typer's underscore spelling too)."""
    name = getattr(args, "attn_implementation", None)
    rest = list(getattr(args, "serve_args", None) or [])
    for i, arg in enumerate(rest):
        option, equals, value = arg.partition("=")
        if option in ("--attn-implementation", "--attn_implementation"):
            name = value if equals else (rest[i + 1] if i + 1 < len(rest) else "")
    return name


def attention_backends() -> list[str]:
    """The names `attn_implementation` takes here: eager and every function registered with transformers'
    AttentionInterface (the package's among them), but the differential functions behind them."""
    from transformers import AttentionInterface

    from ..integrations.attention import register_attention_backends

    register_attention_backends()  # the package's names, also where only the command line was imported
    names = {"eager", *AttentionInterface._global_mapping}
    return sorted(name for name in names if not name.startswith(("differential:", "paged|")))


def check_attn_name(name, option: str = "--attn-implementation") -> None:
    """A `UserError` for a NAME that is no attention backend, decided without importing torch or transformers (from
    `KNOWN_BACKENDS`); whether a known one can run here is `check_attn_implementation`'s, once they are imported."""
    from ..errors import UserError

    if name not in KNOWN_BACKENDS:
        raise UserError(f"{option} {name!r} is not an attention backend: use one of {', '.join(KNOWN_BACKENDS)}.")


def check_attn_implementation(name, option: str = "--attn-implementation") -> str:
    """NAME if it is an attention backend that can run here, else a `UserError` of one line naming the fix."""
    import torch
    import transformers.utils

    from ..errors import UserError

    known = attention_backends()
    if name not in known:
        raise UserError(f"{option} {name!r} is not an attention backend: use one of {', '.join(known)}.")
    available = FLASH_AVAILABLE.get(name)
    if available and not (torch.cuda.is_available() and getattr(transformers.utils, available)()):
        raise UserError(
            f"{option} {name} needs a CUDA GPU and its flash-attn package, which this machine lacks: use sdpa "
            "(the default) here."
        )
    return name


def resolve_device(name: str | None = "auto", option: str = "--device") -> str:
    """The torch device NAME names: "auto" (or None) is CUDA when torch sees a GPU, else Apple's MPS, else the CPU;
    any other name is checked to exist here (a `UserError` of one line naming the fix otherwise)."""
    import torch

    from ..errors import UserError
    from ..text_input import whole_number

    name = "auto" if name is None else str(name).strip().lower()
    mps = getattr(torch.backends, "mps", None)
    mps_available = mps is not None and mps.is_available()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if mps_available else "cpu"
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and not (kind == "cuda" and whole_number(index) is not None)):
        raise UserError(f"{option} {name!r} is not a device: use auto, cpu, cuda, cuda:N or mps.")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"{option} {name}: torch sees no CUDA GPU here (torch.cuda.is_available() is False): use "
                f"{option} cpu, or {option} auto to take whatever is present."
            )
        count = torch.cuda.device_count()
        if index and int(index) >= count:
            raise UserError(f"{option} {name}: there are {count} CUDA device(s) here: use cuda:0 to cuda:{count - 1}.")
    if kind == "mps" and not mps_available:
        raise UserError(
            f"{option} mps: torch sees no Apple MPS device here: use {option} cpu, or {option} auto to take whatever "
            "is present."
        )
    return name
