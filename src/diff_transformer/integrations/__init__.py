"""What connects the Diff model to other libraries, kept out of the checkpoint's custom code (`configuration_diff.py`
and `modeling_diff.py` import only torch, transformers and each other):

* `auto_classes`: the Diff classes registered with transformers' Auto classes (`import diff_transformer` and
  `checkpoints` run it);
* `attention`, `cpu_attention`: the attention backends ("diff_triton", "diff_map_first" and the CPU paths of sdpa)
  registered with transformers;
* `bitsandbytes`: CPU 4-bit layers keep their differentiable kernel after `eval()` (QLoRA on CPU keeps learning);
* `hub`: the model card, written by `save_pretrained`, `push_to_hub` and the converter;
* `peft`: PEFT's default target modules for `model_type="diff"`;
* `vllm`: the vLLM model and its plugin entry point (imports vLLM; never imported by `import diff_transformer`).

`install()` applies the first four to the package's model classes; `import diff_transformer` calls it.
"""

from .attention import register_attention_backends
from .bitsandbytes import install_bitsandbytes_hooks
from .hub import install_card_hooks
from .peft import install_peft_hooks


def install() -> None:
    register_attention_backends()
    install_bitsandbytes_hooks()
    install_card_hooks()
    install_peft_hooks()
