"""Task heads (sequence / token classification, question answering) on Diff models, as Llama has them: transformers'
generic heads over DiffModel, the Auto classes and auto_map (also as Hub custom code), padding by pad_token_id,
PEFT's SEQ_CLS, and conversion of Llama-family heads (score / qa_outputs copied)."""

import json
import re
import textwrap

import pytest
import torch
from peft import AutoPeftModelForSequenceClassification, LoraConfig, get_peft_model
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from diff_transformer import (
    DiffForQuestionAnswering,
    DiffForSequenceClassification,
    DiffForTokenClassification,
    DiffModel,
    cli,
)
from diff_transformer.conversion import convert_to_diff, verify_conversion
from tests.helpers.processes import run_json
from tests.helpers.tiny import tiny_config


HEADS = {
    "sequence": (DiffForSequenceClassification, AutoModelForSequenceClassification),
    "token": (DiffForTokenClassification, AutoModelForTokenClassification),
    "qa": (DiffForQuestionAnswering, AutoModelForQuestionAnswering),
}


def head_model(kind, diff_version, seed=0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(diff_version, num_labels=3, **overrides)
    model = HEADS[kind][0]._from_config(config, attn_implementation="eager")
    with torch.no_grad():  # less uniform than the fresh init, so that comparisons mean something
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "diff_lambda.proj.weight", "score.weight")):
                param.mul_(8.0)
    return model.eval()


def outputs(result) -> torch.Tensor:
    """Every output of a head as one tensor: logits, or start and end logits."""
    if getattr(result, "start_logits", None) is not None:
        return torch.stack([result.start_logits, result.end_logits])
    return result.logits


PADDED = torch.tensor([[5, 17, 42, 8, 9, 30], [7, 3, 11, 0, 0, 0], [0, 0, 12, 40, 6, 23]])  # pad_token_id = 0
PADDED_MASK = (PADDED != 0).long()


def test_sequence_classification_scores_the_last_non_pad_token(diff_version):
    model = head_model("sequence", diff_version)
    with torch.no_grad():
        logits = model(PADDED, attention_mask=PADDED_MASK).logits  # (B, labels)
        hidden = model.model(PADDED, attention_mask=PADDED_MASK).last_hidden_state  # (B, N, D)
        last = torch.tensor([5, 2, 5])  # right-padded row 1 ends at 2, left-padded row 2 at 5
        assert torch.allclose(logits, model.score(hidden[torch.arange(3), last]), atol=1e-6)
        # right padding changes nothing: the score of row 1 is the score of its 3 tokens alone
        alone = model(PADDED[1:2, :3]).logits
    assert logits.shape == (3, 3) and (alone[0] - logits[1]).abs().max() <= 1e-5
    labels = torch.tensor([0, 2, 1])
    loss = model(PADDED, attention_mask=PADDED_MASK, labels=labels).loss
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits, labels), atol=1e-6)


def test_token_classification_and_question_answering(diff_version):
    tokens = head_model("token", diff_version)
    qa = head_model("qa", diff_version)
    assert isinstance(tokens.model, DiffModel) and isinstance(qa.model, DiffModel)
    labels = torch.randint(0, 3, PADDED.shape)
    result = tokens(PADDED, attention_mask=PADDED_MASK, labels=labels)
    assert result.logits.shape == (3, 6, 3)
    expected_loss = torch.nn.functional.cross_entropy(result.logits.flatten(0, 1), labels.flatten())
    assert torch.allclose(result.loss, expected_loss)
    start, end = torch.tensor([1, 0, 3]), torch.tensor([4, 2, 5])
    result = qa(PADDED, attention_mask=PADDED_MASK, start_positions=start, end_positions=end)
    assert result.start_logits.shape == result.end_logits.shape == (3, 6)
    result.loss.backward()
    assert qa.qa_outputs.weight.grad is not None and qa.model.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("kind", list(HEADS))
def test_auto_classes_and_auto_map(tmp_path, kind):
    model_class, auto_class = HEADS[kind]
    model = head_model(kind, 2)
    assert type(auto_class.from_config(model.config)) is model_class
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [model_class.__name__]
    assert config["auto_map"][auto_class.__name__] == f"modeling_diff.{model_class.__name__}"
    reloaded = auto_class.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is model_class
    with torch.no_grad():
        expected = outputs(model(PADDED, attention_mask=PADDED_MASK))
        assert torch.equal(outputs(reloaded(PADDED, attention_mask=PADDED_MASK)), expected)
    card = (tmp_path / "README.md").read_text()
    tag = {"sequence": "text-classification", "token": "token-classification", "qa": "question-answering"}[kind]
    assert f"pipeline_tag: {tag}" in card and f"{auto_class.__name__}.from_pretrained" in card


# Runs where `import diff_transformer` fails (see _subprocess.py): each head through its Auto class as custom code.
REMOTE_LOADER = textwrap.dedent(
    """
    import json, sys
    import torch
    import transformers

    ids, mask = torch.tensor(json.loads(sys.argv[1])), torch.tensor(json.loads(sys.argv[2]))
    report = {"imported_diff_transformer": None, "heads": {}}
    for path, auto_name in json.loads(sys.argv[3]):
        auto_class = getattr(transformers, auto_name)
        model = auto_class.from_pretrained(path, trust_remote_code=True, attn_implementation="eager").eval()
        with torch.no_grad():
            result = model(ids, attention_mask=mask)
        if "start_logits" in result:
            values = torch.stack([result.start_logits, result.end_logits])
        else:
            values = result.logits
        report["heads"][path] = {
            "class": type(model).__name__, "module": type(model).__module__, "outputs": values.tolist()
        }
    report["imported_diff_transformer"] = any(m.startswith("diff_transformer") for m in sys.modules)
    print(json.dumps(report))
    """
)


def test_heads_load_as_remote_code_without_the_package(tmp_path, diff_version):
    models, jobs = {}, []
    for kind, (model_class, auto_class) in HEADS.items():
        path = str(tmp_path / kind)
        models[path] = head_model(kind, diff_version)
        models[path].save_pretrained(path)
        jobs.append((path, auto_class.__name__))
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    args = (json.dumps(PADDED.tolist()), json.dumps(PADDED_MASK.tolist()), json.dumps(jobs))
    report = run_json(REMOTE_LOADER, *args, env=env)
    assert report["imported_diff_transformer"] is False
    for path, model in models.items():
        loaded = report["heads"][path]
        assert loaded["class"] == type(model).__name__ and loaded["module"].startswith("transformers_modules."), loaded
        with torch.no_grad():
            expected = outputs(model(PADDED, attention_mask=PADDED_MASK))
        assert torch.allclose(torch.tensor(loaded["outputs"]), expected, atol=1e-6), path


def test_peft_seq_cls_trains_saves_and_reloads(tmp_path):
    head_model("sequence", 2).save_pretrained(tmp_path / "base")
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", attn_implementation="eager")
    peft_model = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8))
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert any("q_proj.lora_A" in name for name in trainable) and any("v_proj.lora_B" in name for name in trainable)
    assert any("score.modules_to_save" in name for name in trainable)  # SEQ_CLS trains the new head too
    assert not any("k_proj.lora" in name or "embed_tokens" in name for name in trainable)  # Llama's default targets

    labels = torch.tensor([0, 2, 1])
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=3e-2)
    peft_model.train()
    losses = []
    for _ in range(8):
        loss = peft_model(input_ids=PADDED, attention_mask=PADDED_MASK, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    peft_model.eval().save_pretrained(tmp_path / "adapter")
    adapter = tmp_path / "adapter"
    reloaded = AutoPeftModelForSequenceClassification.from_pretrained(adapter, attn_implementation="eager")
    with torch.no_grad():
        expected = peft_model(input_ids=PADDED, attention_mask=PADDED_MASK).logits
        assert torch.equal(reloaded.eval()(input_ids=PADDED, attention_mask=PADDED_MASK).logits, expected)


def _randomize(model):
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model.eval()


LAYOUT = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    num_labels=3,
)


@pytest.mark.parametrize(
    "source_class,config",
    [
        (LlamaForSequenceClassification, LlamaConfig(**LAYOUT)),
        (Qwen2ForSequenceClassification, Qwen2Config(**{**LAYOUT, "tie_word_embeddings": True})),
    ],
    ids=["llama", "qwen2-tied"],
)
def test_sequence_classifier_converts_to_v2_with_identical_scores(tmp_path, capsys, source_class, config):
    torch.manual_seed(0)
    config.id2label = {0: "negative", 1: "neutral", 2: "positive"}
    config.label2id = {v: k for k, v in config.id2label.items()}
    source = _randomize(source_class(config))
    source.save_pretrained(tmp_path / "src")
    capsys.readouterr()
    assert cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "diff"), "--verify", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert float(re.search(r"max \|Δlogit\| = ([^,\s]+)", out).group(1)) <= 1e-5, out

    converted = AutoModelForSequenceClassification.from_pretrained(tmp_path / "diff").eval()
    assert type(converted) is DiffForSequenceClassification and converted.config.diff_version == 2
    assert converted.config.id2label == config.id2label and converted.config.pad_token_id == 0
    assert torch.equal(converted.score.weight, source.score.weight)
    ids = torch.randint(3, 101, PADDED.shape, generator=torch.Generator().manual_seed(3)).masked_fill(PADDED == 0, 0)
    with torch.no_grad():
        expected = source(ids, attention_mask=PADDED_MASK).logits  # right- and left-padded rows
        got = converted(ids, attention_mask=PADDED_MASK).logits
    assert (expected - got).abs().max() <= 1e-5
    assert torch.equal(expected.argmax(-1), got.argmax(-1))
    # V1 (paper layout, not exact) takes the head as it is too
    v1 = convert_to_diff(tmp_path / "src", tmp_path / "v1", diff_version=1, progress=False)
    v1, info = DiffForSequenceClassification.from_pretrained(v1, output_loading_info=True)
    assert not any(info.values()) and torch.equal(v1.score.weight, source.score.weight), info
    # and so does the expanded V1 layout (the one odd head counts get), with one differential head per source head
    wide = convert_to_diff(tmp_path / "src", tmp_path / "v1x", diff_version=1, v1_layout="expanded", progress=False)
    wide, info = DiffForSequenceClassification.from_pretrained(wide, output_loading_info=True)
    assert not any(info.values()) and torch.equal(wide.score.weight, source.score.weight), info
    assert wide.config.num_attention_heads == config.num_attention_heads
    with torch.no_grad():
        assert wide(ids, attention_mask=PADDED_MASK).logits.isfinite().all()


@pytest.mark.parametrize("source_class", [LlamaForTokenClassification, LlamaForQuestionAnswering])
def test_token_classifier_and_qa_convert_exactly(tmp_path, source_class):
    """LlamaForQuestionAnswering stores its decoder under `transformer.`; the Diff head under `model.`."""
    torch.manual_seed(0)
    source = _randomize(source_class(LlamaConfig(**LAYOUT)))
    source.save_pretrained(tmp_path / "src")
    out = convert_to_diff(tmp_path / "src", tmp_path / "diff", progress=False)
    report = verify_conversion(tmp_path / "src", out)
    assert report["passed"] and report["max_abs_logit_diff"] <= 1e-5 and report["greedy_match"] is None, report
    qa = source_class is LlamaForQuestionAnswering
    converted = (DiffForQuestionAnswering if qa else DiffForTokenClassification).from_pretrained(out).eval()
    assert torch.equal(converted.get_input_embeddings().weight, source.get_input_embeddings().weight)
    with torch.no_grad():
        expected = outputs(source(PADDED, attention_mask=PADDED_MASK))  # (2, B, N) start/end or (B, N, labels)
        got = outputs(converted(PADDED, attention_mask=PADDED_MASK))
    difference = (expected - got)[:, PADDED_MASK.bool()] if qa else (expected - got)[PADDED_MASK.bool()]
    assert difference.abs().max() <= 1e-5  # at the unpadded positions
