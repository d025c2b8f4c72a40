"""`diff-transformer convert SRC OUT`: a Llama, Mistral, Qwen2, Qwen3, DiffLlama or Motif checkpoint into a Diff
checkpoint (`diff_transformer.conversion`), optionally verified against its source."""

import sys
import time
from pathlib import Path

from .options import add_quiet_option


def add_parser(commands) -> None:
    convert = commands.add_parser(
        "convert",
        help="convert a Llama, Mistral, Qwen2, Qwen3, DiffLlama or Motif checkpoint into a Diff checkpoint",
    )
    convert.add_argument(
        "src", help="source checkpoint directory or Hub model id org/name (hf://name forces a Hub id)"
    )
    convert.add_argument("out", help="output directory")
    convert.add_argument(
        "--diff-version", type=int, choices=(1, 2), default=None, help="2 (default for Llama): exact; 1: paper layout"
    )
    convert.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="cast weights (default: keep)"
    )
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    convert.add_argument(
        "--verify",
        action="store_true",
        help="compare logits and greedy continuations with the source (with --dtype: the source cast the same way)",
    )
    convert.add_argument(
        "--v1-init",
        choices=("calibrated", "calibrated-additive", "calibrated-lambda0", "paper"),
        default=None,
        help="with --diff-version 1: calibrated (default: differential, λ > 0 from the start and kept above 0.05; "
        "o_proj and λ fitted on text), calibrated-additive (λ fitted in [-1, 0.5]: the second map is "
        "ADDED, not subtracted, at the start; closest to the source), calibrated-lambda0 (λ = 0 at start) or paper",
    )
    convert.add_argument(
        "--v1-layout",
        choices=("paired", "expanded"),
        default=None,
        help="with --diff-version 1: paired (pairs of Llama heads, every weight reused; even head counts) or expanded "
        "(one differential head per Llama head, a second map and value half added; any head count). Default: "
        "paired where possible",
    )
    convert.add_argument(
        "--calibration-data",
        metavar="FILE",
        default=None,
        help="UTF-8 text to calibrate V1 on, its last fifth held out to measure the start (default: text sampled from "
        "SRC itself, seeded)",
    )
    convert.add_argument(
        "--device",
        default="cpu",
        help="where V1's calibration (sampling its text, fitting each layer) and --verify run: cpu, cuda, cuda:N or "
        "auto (CUDA if present). A GPU samples other text than the CPU, so the V1 start differs from a CPU run's",
    )
    add_quiet_option(convert)
    convert.set_defaults(func=run, early_check=_check_device_option)


def _check_device_option(args) -> None:
    """--device before SRC is even resolved (a GPU's name needs torch: the default, cpu, is known without it); the
    converter checks it again for callers of its functions (`conversion.options.checked_options`)."""
    if args.device != "cpu":
        from diff_transformer.conversion.device import check_device

        args.device = check_device(args.device)


def run(args) -> int:
    import json

    from diff_transformer.conversion import convert_to_diff

    out = convert_to_diff(
        args.src,
        args.out,
        diff_version=args.diff_version,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=not args.quiet,  # a bar on a terminal, lines in a log (progress.Progress)
        **{
            name: value
            for name, value in vars(args).items()
            if name in ("v1_init", "v1_layout", "calibration_data", "device") and value is not None
        },
    )
    print(f"wrote {out}")
    conversion = json.loads((Path(out) / "config.json").read_text(encoding="utf-8")).get("conversion") or {}
    if conversion.get("v1_layout") == "expanded":
        print(
            "V1 layout: expanded (one differential head per Llama head; q2, k2 copied from q1, k1 and a value half "
            "added: more parameters and KV cache, see docs/converting.md)"
            + ("" if args.v1_layout else ", since the head counts cannot be paired")
            + "."
        )
    if "calibration_tokens" in conversion:  # a calibrated V1 start (any kind) records what it read and fitted
        print(_calibrated_start(conversion))
        step0 = conversion.get("step0_heldout")
        if step0:
            from diff_transformer.evaluation import format_perplexity

            print(
                f"V1 at step 0: perplexity {format_perplexity(step0['converted_perplexity'], 2)} against the "
                f"source's {format_perplexity(step0['source_perplexity'], 2)} ({step0['ratio']:.2f}x) on "
                f"{_step0_tokens(step0)} of the "
                f"calibration text ({conversion['calibration_text']}), never fitted on; not the held-out Austen "
                "text that the demo and --verify score."
            )
    if args.diff_version == 1 and not conversion.get("function_preserving"):  # Llama-shaped -> V1
        closer = ""
        if conversion.get("v1_init") == "calibrated" and conversion.get("v1_layout") == "paired":  # it works there
            closer = " (or use --v1-init calibrated-additive, which starts closer but adds its second map)"
        print(f"note: diff_version=1 is not function-preserving: continue pretraining{closer}.")
    if args.verify:
        from diff_transformer.evaluation import format_perplexity, heldout_description

        report = _verify(args, out)
        greedy = "" if report["greedy_match"] is None else f", greedy continuations match: {report['greedy_match']}"
        print(
            f"verify (against {report['reference']}, both run in {report['dtype']}): max |Δlogit| = "
            f"{report['max_abs_logit_diff']:.3g}{greedy}  ({report['seconds']:.1f} s)"
        )
        if report["heldout"] is not None:
            heldout = report["heldout"]
            print(
                f"held-out perplexity on {heldout_description(heldout['tokens'])}, as the demo scores it: source "
                f"{format_perplexity(heldout['source'], 4)}, converted {format_perplexity(heldout['converted'], 4)}"
            )
        if not report["expected_exact"]:  # Llama -> V1: a new model that starts near the source, not the source
            print(
                "note: this conversion is not function-preserving, so the comparison above is informational (it "
                "does not set the exit status): the V1 model starts near the source and needs continued pretraining."
            )
        elif not report["passed"]:
            print(
                f"error: the conversion is not exact: max |Δlogit| {report['max_abs_logit_diff']:.3g} exceeds "
                f"{report['atol']:g} or the greedy continuations differ, where this conversion must reproduce the "
                "source; please report this bug (exit status 1).",
                file=sys.stderr,
            )
            return 1
    return 0


def _step0_tokens(step0: dict) -> str:
    """ "3,825 held-out tokens (15 blocks × 255)"; a record written before the blocks were recorded: the count."""
    tokens = f"{step0['tokens']:,} held-out tokens"
    if "blocks" in step0:
        tokens += f" ({step0['blocks']} blocks × {step0['block_tokens']})"
    return tokens


def _calibrated_start(conversion: dict) -> str:
    """One line: what the calibration read, what it fitted (o_proj; λ where it was chosen) and whether the two
    attention maps differ yet."""
    blocks, length = conversion["calibration_tokens"]
    expanded = conversion.get("v1_layout") == "expanded"
    if "lambda_start" in conversion:
        start = f"λ at step 0 fitted per layer: {conversion['lambda_start']}"
    elif conversion.get("v1_init") == "calibrated-lambda0":
        start = "λ = 0 at step 0 (λ_init 0, mirrored λ vectors): the second map is not used yet"
    else:
        start = "λ = the paper's λ_init per layer at step 0"
    if expanded:  # q2, k2 are copies of q1, k1
        maps = (
            "A2 = A1 at step 0 (q2, k2 copied from q1, k1): the two maps do not differ yet, so each head computes "
            "(1 − λ)·A1·V and cancels nothing until training moves q2, k2 apart"
        )
        if conversion.get("steady_value"):
            maps += (
                f"; channel 0 of each value group's second half reads the input's steadiest direction at "
                f"{conversion['steady_value']:g}x the first half's norm, so the sub-layer norm starts nearly linear"
            )
    else:
        maps = "A1 and A2 are two different Llama heads' maps"
    return (
        f"V1 calibrated on {conversion['calibration_text']} ({blocks} blocks x {length} tokens): o_proj refitted per "
        f"layer by least squares (sub-layer norm weight kept at 1), {start}; {maps}; relative residual of the "
        f"attention output per layer {conversion['subln_relative_residual']}."
    )


def _verify(args, out) -> dict:
    """`verify_conversion` with the built-in held-out text (the demo's), announced first and timed: it loads both
    models whole, which takes a while for a real checkpoint."""
    from diff_transformer.cli.demo import shipped_assets
    from diff_transformer.conversion import verify_conversion

    print(f"verifying {out} against {args.src}: loading both models, comparing logits and perplexity ...", flush=True)
    start = time.perf_counter()
    with shipped_assets() as (_, heldout):
        text = heldout.read_text(encoding="utf-8")
    report = verify_conversion(args.src, out, heldout_text=text, progress=not args.quiet, device=args.device)
    return {**report, "seconds": time.perf_counter() - start}
