"""The model card (README.md) of a Diff checkpoint, and the hooks that write it on `save_pretrained` and `push_to_hub`.

One generator (`diff_model_card`) serves `save_pretrained`, both push paths and the converter. It lives in the
package, not in the checkpoint's custom code (which is the model and nothing else): a model loaded as Hub custom code
where the package is not installed saves and pushes as any custom-code model does (transformers' own card on push).
"""

import os

from transformers import PreTrainedModel

from ..configuration_diff import DiffConfig
from ..families import family_of
from ..modeling_diff import DiffPreTrainedModel


# What `config.conversion["card_data"]` may hold: the source card's fields that must follow the weights (a derivative
# keeps its source's licence), each a short string (`language`: or a list of them). The card sets base_model,
# pipeline_tag and tags itself, so a config.json cannot put other YAML into the card through it.
CARD_DATA_KEYS = ("license", "license_name", "license_link", "language")
CARD_TEXT_MAX = 256  # characters of one value
CARD_LIST_MAX = 64  # languages


def card_data_problem(card_data) -> str | None:
    """Why `card_data` cannot go into a model card (None: it can): the keys, types and sizes above."""
    if not isinstance(card_data, dict):
        return f"card_data must be a mapping, not {type(card_data).__name__}"
    for key, value in card_data.items():
        if key not in CARD_DATA_KEYS:
            return f"card_data holds {key!r}: only {', '.join(CARD_DATA_KEYS)} are copied from a source card"
        values = value if key == "language" and isinstance(value, list) else [value]
        if len(values) > CARD_LIST_MAX:
            return f"card_data[{key!r}] lists {len(values)} values (at most {CARD_LIST_MAX})"
        for item in values:
            if not isinstance(item, str) or len(item) > CARD_TEXT_MAX:
                return f"card_data[{key!r}] must be a string of at most {CARD_TEXT_MAX} characters (or a list of them)"
    return None


def config_card_data_problem(config: DiffConfig) -> str | None:
    """`card_data_problem` of a config's `conversion` (None: no conversion, or card data the card can carry)."""
    return card_data_problem((config.conversion or {}).get("card_data") or {})


def _check_card_data(config: DiffConfig) -> None:
    problem = config_card_data_problem(config)
    if problem:
        raise ValueError(f"config.conversion: {problem}: fix or remove conversion.card_data in config.json.")


# The text of the card transformers writes when a repo has none (`transformers.utils.hub.create_and_tag_model_card`).
TRANSFORMERS_PLACEHOLDER_CARD = "This model card has been automatically generated."


# Task heads: (pipeline tag, Auto class, example call); anything else is a causal LM.
_TASKS = {
    "DiffForSequenceClassification": (
        "text-classification",
        "AutoModelForSequenceClassification",
        'print(pipe("A sentence to classify."))',
    ),
    "DiffForTokenClassification": (
        "token-classification",
        "AutoModelForTokenClassification",
        'print(pipe("A sentence to tag."))',
    ),
    "DiffForQuestionAnswering": (
        "question-answering",
        "AutoModelForQuestionAnswering",
        'print(pipe(question="Who wrote it?", context="It was written by Jane Austen."))',
    ),
}
_CAUSAL_LM = (
    "text-generation",
    "AutoModelForCausalLM",
    'print(pipe("Once upon a time", max_new_tokens=32)[0]["generated_text"])',
)


def _task(config: DiffConfig) -> tuple[str, str, str]:
    """(pipeline tag, Auto class, example call) of the head `config.architectures` names."""
    return next((_TASKS[a] for a in config.architectures or [] if a in _TASKS), _CAUSAL_LM)


def _card_data(config: DiffConfig):
    """YAML metadata the Hub understands; base_model and the source's licence/language for converted models."""
    from huggingface_hub import ModelCardData

    conversion = config.conversion or {}
    tags = ["diff-transformer", "differential-attention", f"diff-transformer-v{config.diff_version}", "custom_code"]
    if conversion.get("source_model_type"):
        tags.append(conversion["source_model_type"])
    return ModelCardData(
        base_model=conversion.get("base_model"),
        library_name="transformers",
        pipeline_tag=_task(config)[0],
        tags=tags,
        **(conversion.get("card_data") or {}),  # checked by `diff_model_card`
    )


def _version_texts(config: DiffConfig) -> tuple[str, str, str]:
    """(which paper, the attention formula, the λ paragraph) of the config's `diff_version`."""
    if config.diff_version == 1:
        variant = "Diff Transformer V1, the ICLR 2025 paper (Ye et al., [arXiv:2410.05258](https://arxiv.org/abs/2410.05258))"
        attention = "O_h = RMSNorm((A1 − λ·A2) · V_g(h)) · (1 − λ_init), A_c = softmax(Q_c K_cᵀ / √d), V 2d wide"
        schedule = ", ".join(f"{config.lambda_init_for_layer(i):.3f}" for i in range(config.num_hidden_layers))
        offset = getattr(config, "lambda_init_depth_offset", 0)
        depth = "layer" if not offset else f"(layer {'+' if offset > 0 else '−'} {abs(offset)})"
        if config.lambda_init is None:
            init_text = f"the paper's depth schedule λ_init = 0.8 − 0.6·exp(−0.3·{depth}), per layer: {schedule}"
        else:
            init_text = f"fixed λ_init = {config.lambda_init} in every layer"
        lam = (
            "λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init: one learned fp32 scalar per layer "
            f"(`diff_lambda.lambda_{{q1,k1,q2,k2}}`, vectors of size d = {config.head_dim}, initialised "
            f"N(0, {config.lambda_std}²)), with {init_text}."
        )
        return variant, attention, lam
    variant = "Diff Transformer V2, the authors' 2026 revision of differential attention"
    attention = "O_h = a_2h − λ_h · a_2h+1, a_j = softmax(Q_j K_G(j)ᵀ / √d) · V_G(j): 2H query heads over Llama's K/V"
    lam = (
        "λ = sigmoid(W_λ x): one value per token and per differential head (`diff_lambda.proj`, "
        f"{config.hidden_size} → {config.num_attention_heads}, no bias); no subln."
    )
    family = family_of((config.conversion or {}).get("source_model_type"))
    if family is not None and family.llama_shaped:
        lam += " The converter set W_λ = 0, so λ = 0.5 everywhere at step 0."
    return variant, attention, lam


def _architecture_table(config: DiffConfig, attention: str) -> str:
    rope = config.rope_parameters or {}
    rows = [
        ("diff_version", config.diff_version),
        ("attention", attention),
        ("layers", config.num_hidden_layers),
        ("hidden size", config.hidden_size),
        ("differential heads H", config.num_attention_heads),
        ("key/value heads", config.num_key_value_heads),
        ("head_dim d", config.head_dim),
        ("MLP size", config.intermediate_size),
        ("vocabulary", config.vocab_size),
        ("context (max_position_embeddings)", config.max_position_embeddings),
        ("RoPE", f"{rope.get('rope_type', 'default')}, θ = {rope.get('rope_theta', '?')}"),
        ("tied embeddings", "yes" if config.tie_word_embeddings else "no"),
    ]
    if getattr(config, "num_noise_heads", None) is not None:  # grouped differential attention (Motif-2-12.7B)
        rows.insert(5, ("noise heads (grouped differential attention)", config.num_noise_heads))
    if config.hidden_act == "poly_norm":
        rows.insert(-4, ("MLP activation", 'PolyNorm (`hidden_act="poly_norm"`)'))
    return "\n".join(f"| {key} | {value} |" for key, value in rows)


def _provenance(config: DiffConfig) -> str:
    """The "Conversion" section of a converted model (empty for a model built as a Diff model)."""
    conversion = config.conversion or {}
    if not conversion:
        return ""
    base = conversion.get("base_model")
    source = f"[`{base}`](https://huggingface.co/{base})" if base else f"`{conversion.get('source')}`"
    family = family_of(conversion.get("source_model_type"))
    method = family.card_method(config.diff_version) if family is not None else ""
    exact = "yes" if conversion.get("function_preserving") else "no"
    return (
        f'\n## Conversion\n\nConverted from {source} (`model_type="{conversion.get("source_model_type")}"`) with '
        f"{conversion.get('converter', 'diff-transformer')}. Function-preserving at conversion: {exact}. {method}"
        f"{_v1_init(conversion)}\n"
    )


def _v1_init(conversion: dict) -> str:
    """How a Llama -> V1 conversion started (`convert --v1-init`, `--v1-layout`)."""
    layout = ""
    if conversion.get("v1_layout") == "expanded":
        layout = (
            " Layout: expanded (the source's heads could not be paired, or --v1-layout expanded was asked): one "
            "differential head per source head; q2 and k2 started as copies of q1 and k1 (A2 = A1 at step 0: the two "
            "maps differ only once training moves them apart) and a second value half was added behind zero `o_proj` "
            "columns (calibrated: its channel 0 reads the layer input along its steadiest direction, so the sub-layer "
            "norm starts nearly linear)."
        )
    if conversion.get("v1_init") == "paper":
        return layout + (
            " Start: the paper's (λ_init depth schedule, λ vectors drawn at random, unit sub-layer norm gains)."
        )
    if "calibration_tokens" not in conversion:  # no calibrated V1 start recorded
        return layout
    blocks, length = conversion["calibration_tokens"]
    lambdas = ", ".join(f"{value:g}" for value in conversion.get("lambda_start", ()))
    if conversion.get("v1_init") == "calibrated-additive":
        start = (
            f"additive: λ_init = 0 and each layer's λ fitted on text ({lambdas}), set through λq2; λ < 0 ADDS the "
            "second attention map instead of subtracting it, which starts closer to the source but is not "
            "differential attention until training makes λ positive (no floor keeps it so); "
        )
    elif "lambda_start" in conversion:
        start = (
            f"differential: λ_init = 0 and each layer's λ fitted on text in [0.1, 0.5] ({lambdas}), set through λq2 "
            "so it learns from the first step, and kept above `lambda_floor` throughout training; "
        )
    elif conversion.get("v1_layout") == "expanded":
        start = (
            "differential: λ = the paper's λ_init per layer (λq2 = λq1, λk2 = λk1), kept above `lambda_floor` "
            "throughout training; "
        )
    else:
        start = "λ_init = 0 with λq2 = λq1 and λk2 = λk1, so λ = 0 exactly at step 0 and learns from the first step; "
    step0 = conversion.get("step0_heldout")
    quality = ""
    if step0:
        from ..evaluation import format_perplexity

        quality = (
            f" At step 0 its perplexity on {step0['tokens']:,} held-out tokens of the calibration data was "
            f"{format_perplexity(step0['converted_perplexity'], 2)} against the source's "
            f"{format_perplexity(step0['source_perplexity'], 2)} "
            f"({step0['ratio']:.2f}×)."
        )
    return layout + (
        f" Start: calibrated, {start}`o_proj` was refitted per layer, in layer order, by least squares so that the "
        "normalised differential heads reproduce the source's attention output, on "
        f"{conversion.get('calibration_text')} ({blocks} blocks of {length} tokens).{quality}"
    )


def diff_model_card(config: DiffConfig, model_id: str | None = None):
    """The model card (README.md) of a Diff checkpoint, as a `huggingface_hub.ModelCard`.

    YAML metadata the Hub understands (library_name, pipeline_tag, tags; base_model and the source's licence for
    converted models) and a body with the architecture, `diff_version`, the λ settings, the conversion provenance and
    a usage snippet. The one card generator: `save_pretrained`, `push_to_hub` and the converter all call it. A
    converted model's provenance lives in `config.conversion`, so re-saving or pushing it later keeps `base_model`.
    """
    from huggingface_hub import ModelCard

    _check_card_data(config)
    name = model_id or "PATH_OR_ID"
    variant, attention, lam = _version_texts(config)
    table = _architecture_table(config, attention)
    provenance = _provenance(config)
    pipeline_tag, auto_class, example = _task(config)
    head = (config.architectures or ["DiffForCausalLM"])[0]
    body = f"""
# {name}

A differential-attention language model: {variant}, in a Llama-style decoder (`model_type="diff"`,
`{head}`), made with diff-transformer (not on a package index yet: `pip install -e .` in a checkout of its
source).

## Architecture

| | |
|---|---|
{table}

## λ (differential weight)

{lam}
{provenance}
## Usage

```python
from transformers import {auto_class}, AutoTokenizer, pipeline

model = {auto_class}.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)
pipe = pipeline("{pipeline_tag}", model=model, tokenizer=tokenizer)
{example}
```

The checkpoint carries its code (`configuration_diff.py`, `modeling_diff.py`), hence
`trust_remote_code=True`. With the diff-transformer package installed (from its source: `pip install -e .`),
`import diff_transformer` registers the model with the Auto classes (no remote code needed), and
`diff-transformer serve` serves it through transformers' OpenAI-compatible server (`pip install -e ".[serve]"`).
"""
    return ModelCard(f"---\n{_card_data(config).to_yaml()}\n---\n{body}")


def _save_pretrained(self, save_directory, *args, **kwargs):
    """`PreTrainedModel.save_pretrained`, plus a model card (README.md, see `diff_model_card`) unless the directory
    already has one: a card that is there (the user's, or one from an earlier save) is never replaced.

    Relies on: `save_pretrained`'s first positional argument after the directory being `is_main_process`.
    Guarded by tests/hub/test_card.py (test_save_pretrained_writes_a_card_with_architecture_and_lambda,
    test_a_readme_already_in_the_directory_is_kept, test_only_the_main_process_writes_the_card).
    """
    _check_card_data(self.config)  # before anything is written, not after the weights
    readme = os.path.join(save_directory, "README.md")
    had_card = os.path.isfile(readme)
    PreTrainedModel.save_pretrained(self, save_directory, *args, **kwargs)
    is_main_process = kwargs.get("is_main_process", args[0] if args else True)
    if is_main_process and not had_card and not os.path.isfile(readme):
        diff_model_card(self.config, os.path.basename(os.path.normpath(save_directory))).save(readme)


def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
    # Relies on: both push paths (`PushToHubMixin.push_to_hub`, `save_pretrained(push_to_hub=True)`) writing
    # README.md (`create_and_tag_model_card`) just before calling `_upload_modified_files`: the Hub repo's own card
    # if it has one (kept), else transformers' generic placeholder, which becomes this model's card here, keeping
    # the tags transformers collected (`model_tags`, `tags=`). Guarded by tests/hub/test_card.py
    # (test_push_to_hub_uploads_the_diff_card_not_transformers_placeholder,
    # test_push_keeps_a_card_already_on_the_hub,
    # test_save_pretrained_push_to_hub_writes_the_card_locally_and_on_the_hub).
    readme = os.path.join(working_dir, "README.md")
    if os.path.isfile(readme):
        from huggingface_hub import ModelCard

        pushed = ModelCard.load(readme)
        if TRANSFORMERS_PLACEHOLDER_CARD in pushed.text:
            card = diff_model_card(self.config, repo_id)
            card.data.tags += [tag for tag in pushed.data.tags or [] if tag not in card.data.tags]
            card.save(readme)
    return PreTrainedModel._upload_modified_files(self, working_dir, repo_id, *args, **kwargs)


def install_card_hooks(model_class: type = DiffPreTrainedModel) -> None:
    """Write the card on `model_class.save_pretrained` and `push_to_hub` (the package's models, every head)."""
    model_class.save_pretrained = _save_pretrained
    model_class._upload_modified_files = _upload_modified_files


__all__ = [
    "CARD_DATA_KEYS",
    "TRANSFORMERS_PLACEHOLDER_CARD",
    "card_data_problem",
    "config_card_data_problem",
    "diff_model_card",
    "install_card_hooks",
]
