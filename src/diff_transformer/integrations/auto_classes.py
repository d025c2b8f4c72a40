"""The Diff classes registered with transformers' Auto classes (`AutoConfig`, `AutoModel`, `AutoModelForCausalLM` and
the task heads'), so that `from_pretrained` resolves `model_type="diff"` natively (no `trust_remote_code`).
`import diff_transformer` runs it, and so does `checkpoints/` before it reads a config or loads a model, without
importing the package root (its public names and `integrations.install()`)."""

# transformers' Auto class -> our class it resolves "diff" to (and whose source `save_pretrained` copies)
AUTO_CLASSES = {
    "AutoConfig": "DiffConfig",
    "AutoModel": "DiffModel",
    "AutoModelForCausalLM": "DiffForCausalLM",
    "AutoModelForSequenceClassification": "DiffForSequenceClassification",
    "AutoModelForTokenClassification": "DiffForTokenClassification",
    "AutoModelForQuestionAnswering": "DiffForQuestionAnswering",
}

_registered = False


def register_auto_classes() -> None:
    """Register the classes of `AUTO_CLASSES` with transformers, once per process."""
    global _registered
    if _registered:
        return
    import transformers

    from .. import modeling_diff
    from ..configuration_diff import DiffConfig

    for auto_class, ours in AUTO_CLASSES.items():
        if auto_class == "AutoConfig":
            transformers.AutoConfig.register(DiffConfig.model_type, DiffConfig, exist_ok=True)
            cls = DiffConfig
        else:
            cls = getattr(modeling_diff, ours)
            getattr(transformers, auto_class).register(DiffConfig, cls, exist_ok=True)
        # `save_pretrained` copies the class's source file next to the weights and writes `auto_map`, so saved models
        # also load with `trust_remote_code=True` where this package is not installed.
        cls.register_for_auto_class(auto_class)
    _registered = True


__all__ = ["AUTO_CLASSES", "register_auto_classes"]
