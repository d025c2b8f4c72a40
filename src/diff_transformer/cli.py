"""The `diff-transformer` command: demo, convert, generate, train."""

import argparse
import sys
import tempfile
import time
from pathlib import Path


def _demo(args) -> int:
    """Offline main job: the shipped tiny Llama (real tokenizer, trained on Austen) -> Diff V2, verified, generating."""
    if args.scratch:
        return _scratch_demo(args)
    from diff_transformer.demo import run_demo

    kwargs = {"prompt": args.prompt} if args.prompt else {}
    return run_demo(args.output, **kwargs)


def _scratch_demo(args) -> int:
    """Build small Diff models of both versions, save them, reload through AutoModelForCausalLM, generate."""
    import torch
    from transformers import AutoModelForCausalLM

    from diff_transformer import DiffConfig, DiffForCausalLM

    out = Path(args.output) if args.output else Path(tempfile.mkdtemp(prefix="diff-demo-"))
    prompt = torch.tensor([[1, 17, 42, 7, 99, 3]])
    for version in (1, 2):
        torch.manual_seed(args.seed)
        config = DiffConfig(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=344,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            diff_version=version,
        )
        model = DiffForCausalLM(config).eval()
        path = out / f"diff-v{version}"
        model.save_pretrained(path)
        reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
        start = time.perf_counter()
        generated = reloaded.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            same = torch.equal(model(prompt).logits, reloaded(prompt).logits)
        params = sum(p.numel() for p in reloaded.parameters())
        print(f"Diff V{version}: {params / 1e6:.2f}M params, saved to {path}")
        print(f"  reloaded as {type(reloaded).__name__} via AutoModelForCausalLM; logits identical after reload: {same}")
        print(f"  greedy tokens: {generated[0, prompt.shape[1]:].tolist()} ({16 / seconds:.0f} tokens/s)")
        if not same:
            return 1
    return 0


def _convert(args) -> int:
    from diff_transformer.conversion import ConversionError, convert_to_diff, verify_conversion

    try:
        out = convert_to_diff(
            args.src, args.out, diff_version=args.diff_version, dtype=args.dtype, overwrite=args.overwrite, progress=not args.quiet
        )
        print(f"wrote {out}")
        if args.diff_version == 1:
            print("note: diff_version=1 re-pairs the Llama heads and adds fresh λ: not function-preserving; continue pretraining.")
        if args.verify:
            report = verify_conversion(args.src, out)
            print(f"verify: max |Δlogit| = {report['max_abs_logit_diff']:.3g}, greedy continuations match: {report['greedy_match']}")
            if report["expected_exact"] and not report["passed"]:
                return 1
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import diff_transformer  # noqa: F401  (registers the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError):
        tokenizer = None
    if tokenizer is not None:
        inputs = tokenizer(args.prompt, return_tensors="pt")
    else:
        ids = [int(t) for t in args.prompt.split()]
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    if args.temperature > 0:
        kwargs["temperature"] = args.temperature
    output = model.generate(**inputs, **kwargs)[0, inputs["input_ids"].shape[1] :]
    print(tokenizer.decode(output, skip_special_tokens=True) if tokenizer is not None else " ".join(map(str, output.tolist())))
    return 0


def _train(args) -> int:
    from diff_transformer.training.train import run_cli

    return run_cli(args)


def _serve(args) -> int:
    from diff_transformer.serving import main as serve

    return serve(args.serve_args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="diff-transformer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="offline demo: convert the shipped tiny Llama to Diff V2, verify, generate")
    demo.add_argument("--output", help="where to write the converted model (default: a temporary directory)")
    demo.add_argument("--prompt", help="English prompt to continue")
    demo.add_argument("--scratch", action="store_true", help="instead: build, save, reload random Diff V1/V2 models")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    convert = commands.add_parser("convert", help="convert a Llama (or DiffLlama) checkpoint into a Diff checkpoint")
    convert.add_argument("src", help="source checkpoint directory or Hub model id (never modified)")
    convert.add_argument("out", help="output directory")
    convert.add_argument("--diff-version", type=int, choices=(1, 2), default=None, help="2 (default for Llama): exact; 1: paper layout")
    convert.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="cast weights (default: keep)")
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    convert.add_argument("--verify", action="store_true", help="compare logits and greedy continuations with the source")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=_convert)

    generate = commands.add_parser("generate", help="generate text with a saved Diff model")
    generate.add_argument("model", help="model directory or Hub id")
    generate.add_argument("prompt", help="text (or space-separated token ids if the model has no tokenizer)")
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.set_defaults(func=_generate)

    from diff_transformer.training.args import add_train_arguments

    train = commands.add_parser("train", help="continued pretraining (transformers' Trainer) on local .txt/.jsonl files")
    add_train_arguments(train).set_defaults(func=_train)

    # Every option after `serve` goes to transformers' server: `diff-transformer serve --help` lists them.
    serve = commands.add_parser("serve", add_help=False, help="OpenAI-compatible server (transformers serve) for Diff models")
    serve.set_defaults(func=_serve)

    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.serve_args = rest
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
