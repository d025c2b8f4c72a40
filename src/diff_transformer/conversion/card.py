"""The model card (README.md with YAML metadata) written next to a converted checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

from .source import SourceCheckpoint


_CACHE_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+/?$")
_COPIED_METADATA = ("license", "license_name", "license_link", "language")


def hub_id_of(source: SourceCheckpoint) -> str | None:
    """The Hub id of SRC: given as such, or recovered from an HF cache snapshot path."""
    if source.repo_id:
        return source.repo_id
    match = _CACHE_SNAPSHOT.search(source.path.as_posix())
    if match:
        return f"{match.group('org')}/{match.group('name')}"
    return None


def source_card_metadata(source: SourceCheckpoint) -> dict:
    readme = source.path / "README.md"
    if not readme.is_file():
        return {}
    try:
        from huggingface_hub.repocard import metadata_load

        metadata = metadata_load(readme) or {}
    except Exception:  # a malformed card must not stop a conversion
        return {}
    return {key: metadata[key] for key in _COPIED_METADATA if metadata.get(key)}


def write_model_card(target: Path, source: SourceCheckpoint, config, *, source_kind: str, out_name: str) -> None:
    from huggingface_hub import ModelCardData

    base_model = hub_id_of(source)
    version = config.diff_version
    data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["diff-transformer", "differential-attention", f"diff-transformer-v{version}", source_kind, "custom_code"],
        **source_card_metadata(source),
    )
    source_ref = f"[`{base_model}`](https://huggingface.co/{base_model})" if base_model else f"`{source.path.name}`"
    H, H_kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if source_kind == "diffllama":
        how = (
            "Imported from transformers' DiffLlama into the V1 (paper) layout with the head permutation that reproduces "
            "DiffLlama's logits exactly."
        )
    elif version == 2:
        how = (
            "Converted function-preservingly into Diff Transformer V2: Llama head i became query heads (2i, 2i+1) with "
            "identical rows, the λ projection starts at zero (λ = 0.5) and `o_proj` was doubled, so at step 0 the model "
            "computes exactly what the source computes. Continue pretraining to let the two queries of each pair diverge."
        )
    else:
        how = (
            "Converted into the Diff Transformer V1 (paper) layout by pairing Llama heads into differential heads (each "
            "query kept with the key/value head it was trained with) and reusing every weight, with fresh λ vectors. This is not function-preserving: continue pretraining before use."
        )
    body = f"""
# {out_name}

Differential-attention model (Diff Transformer V{version}, `model_type="diff"`) converted from {source_ref} with
[diff-transformer](https://pypi.org/project/diff-transformer/).

{how}

| | |
|---|---|
| differential heads | {H} |
| key/value heads | {H_kv} |
| head_dim | {d} |
| layers | {config.num_hidden_layers} |
| hidden size | {config.hidden_size} |

## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("PATH_OR_ID", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("PATH_OR_ID")
```

With `pip install diff-transformer`, `import diff_transformer` registers the model with the Auto classes, and
`trust_remote_code` is not needed.
"""
    text = f"---\n{data.to_yaml()}\n---\n{body}"
    (target / "README.md").write_text(text, encoding="utf-8")


__all__ = ["hub_id_of", "source_card_metadata", "write_model_card"]
