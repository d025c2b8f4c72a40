"""bitsandbytes: QLoRA on CPU keeps learning after an evaluation.

bitsandbytes (0.50) `Linear4bit.forward` repacks a CPU 4-bit layer into an AVX512-BF16 inference layout on its first
forward in eval mode without gradients (when the layer's `support_avx512bf16_for_cpu` is set). The repacked matmul has
no autograd, so QLoRA on CPU silently stopped learning after any evaluation (grad_norm 0, λ frozen). `eval()` and
`train()` of a Diff model (and `from_pretrained`, which ends with `eval()`) turn that repacking off, so its CPU 4-bit
layers keep bitsandbytes' differentiable kernel.

This lives in the package, not in the checkpoint's custom code: it works around another library's behaviour, which a
Llama trained the same way shares, by setting one of that library's attributes. Code copied into a checkpoint can never
be updated once pushed, while this can follow bitsandbytes. A model loaded as Hub custom code without the package
behaves as a Llama does (set the attribute to False on its `Linear4bit` layers, as tests/training/test_peft.py does
for its Llama reference). bitsandbytes is never imported here.
"""

import functools

from ..modeling_diff import DiffPreTrainedModel


def keep_4bit_layers_differentiable(model) -> None:
    """Turn off bitsandbytes' CPU inference repacking in every 4-bit layer of `model` (no-op without any).

    Relies on: bitsandbytes' `Linear4bit` deciding to repack from its `support_avx512bf16_for_cpu` attribute.
    Guarded by tests/training/test_peft.py::test_qlora_4bit and
    tests/training/test_train.py::test_qlora_cli_keeps_learning_after_evaluations.
    """
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False


def install_bitsandbytes_hooks(model_class: type = DiffPreTrainedModel) -> None:
    """Apply `keep_4bit_layers_differentiable` on every `train(mode)` of a `model_class` model (`eval()` calls it)."""
    if getattr(model_class.train, "_keeps_4bit_layers_differentiable", False):
        return
    set_mode = model_class.train

    @functools.wraps(set_mode)
    def train(self, mode: bool = True):
        keep_4bit_layers_differentiable(self)
        return set_mode(self, mode)

    train._keeps_4bit_layers_differentiable = True
    model_class.train = train
