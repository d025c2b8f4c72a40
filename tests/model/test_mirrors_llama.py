"""Canary: what the checkpoint's code marks `# Mirrors transformers.models.llama...` still mirrors it.

transformers' utils/check_copies.py keeps `# Copied from` code identical to its source. Diff's classes are Llama's
with intended differences, so this compares them statement by statement instead: each side is parsed with `ast`
(docstrings, comments, `auto_docstring` and the annotations of signatures dropped, an annotated local read as an
assignment, `Llama` read as `Diff`) and unparsed one statement per line, and the lines that differ must be exactly
those INTENDED lists. It fails when transformers changes a mirrored Llama class (a statement added, removed or changed:
review ours, then update INTENDED), and when ours drifts from Llama's without INTENDED saying so.
"""

import ast
import difflib
import hashlib
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass

import pytest

from diff_transformer import configuration_diff, modeling_diff


CHECKPOINT_FILES = (modeling_diff, configuration_diff)
MARKER = re.compile(r"#\s*Mirrors (transformers\.[\w.]+)\s*$")


@dataclass(frozen=True)
class Own:
    """Ours is our own code, not compared; Llama's part is pinned by `llama_hash`: an upstream change still fails."""

    llama_hash: str


@dataclass(frozen=True)
class Elsewhere:
    """Llama's part is compared by the method markers named here."""

    mirrors: tuple[str, ...]


OURS_ONLY = "ours only"  # Llama has no such part

# Marked name -> what differs from Llama. For a class: part ("<class>": bases, decorators and class attributes; else a
# method) -> expected lines. A part left out must not differ. Lines are "- " Llama's (its names read as Diff's), "+ "
# ours, in order; an expected "+ " line ending in "..." matches the statements starting with the rest ("- " lines, the
# upstream side, are always exact).
INTENDED = {
    "DiffAttention": {
        "<class>": ["- @use_kernelized_func(apply_rotary_pos_emb)"],
        "__init__": [
            "- def __init__(self, config, layer_idx):",
            "+ def __init__(self, config, layer_idx, kv_width, output_width, query_width):",
            "- self.head_dim = getattr(config, 'head_dim', config.hidden_size // config.num_attention_heads)",
            "- self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads",
            "+ self.num_heads = config.num_attention_heads",
            "+ self.num_key_value_heads = config.num_key_value_heads",
            "+ self.head_dim = config.head_dim",
            "- self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, "
            "bias=config.attention_bias)",
            "- self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, "
            "bias=config.attention_bias)",
            "- self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, "
            "bias=config.attention_bias)",
            "- self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, "
            "bias=config.attention_bias)",
            "+ hidden, bias = (config.hidden_size, config.attention_bias)",
            "+ out_bias = ...",
            "+ self.q_proj = nn.Linear(hidden, query_width, bias=bias)",
            "+ self.k_proj = nn.Linear(hidden, kv_width, bias=bias)",
            "+ self.v_proj = nn.Linear(hidden, kv_width, bias=bias)",
            "+ self.o_proj = nn.Linear(output_width, hidden, bias=out_bias)",
            "+ self.q_norm = ...",
            "+ self.k_norm = ...",
        ],
        "forward": Elsewhere(("DiffAttentionV1.forward", "DiffAttentionV2.forward")),
    },
    "DiffAttentionV2.forward": [
        "- query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
        "- key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)",
        "+ query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))",
        "+ key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape))",
        "- query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)",
        "+ heads = torch.cat((query_states, key_states), dim=2)",
        "+ heads = heads * cos.unsqueeze(2) + rotate_half(heads) * sin.unsqueeze(2)",
        "+ query_states, key_states = heads.transpose(1, 2).split(...",
        "+ lam = self.diff_lambda(hidden_states)",
        "+ differential = differential_attention_function(self.config._attn_implementation, hidden_states.device)",
        "+ if differential is not None:",
        "+ result = ...",
        "+ if result is not None:",
        "+ return (self.o_proj(result[0].reshape(*input_shape, -1)), result[1])",
        "+ if attn_weights is not None:",
        "+ weights = ...",
        "+ attn_weights = ...",
        "+ dropped = self.training and self.attention_dropout",
        "+ from_map = attention_capabilities(self.config._attn_implementation)[1].output_from_map",
        "+ if attn_weights is not None and from_map and (not dropped):",
        "+ attn_output = _output_from_map(attn_weights, value_states)",
        "+ else:",
        "+ pair = ...",
        "+ attn_output = ...",
    ],
    "DiffAttentionV1.forward": Own("ee9b11aafecd"),
    "DiffMLP": {
        "__init__": [
            "- self.act_fn = ACT2FN[config.hidden_act]",
            "+ self.act_fn = DiffPolyNorm() if config.hidden_act == POLY_NORM else ACT2FN[config.hidden_act]",
        ],
    },
    "DiffDecoderLayer": {
        "__init__": [
            "- self.self_attn = DiffAttention(config=config, layer_idx=layer_idx)",
            "+ self.self_attn = DIFF_ATTENTION_CLASSES[config.diff_version](config=config, layer_idx=layer_idx)",
        ],
    },
    "DiffPreTrainedModel": {
        "<class>": [
            "- bases: PreTrainedModel",
            "+ bases: _PreTrainedModelHooks, PreTrainedModel",
            "+ config_class = DiffConfig",
            "+ _keep_in_fp32_by_version = ...",
        ],
        "__init__": OURS_ONLY,
        "_init_weights": OURS_ONLY,
    },
    "DiffModel": {},
    "DiffForCausalLM": {
        "<class>": [
            "- bases: DiffPreTrainedModel, GenerationMixin",
            "+ bases: _GenerationHooks, DiffPreTrainedModel, GenerationMixin",
            # Not adopted yet: transformers added it to Llama after this copy was made (FSDP2 keeps lm_head whole).
            "- _fsdp_plan = {'lm_head': 'keep_full_weight'}",
        ],
    },
    "DiffForSequenceClassification": {
        "<class>": [
            "- bases: GenericForSequenceClassification, DiffPreTrainedModel",
            "+ bases: _TaskHeadHooks, GenericForSequenceClassification, DiffPreTrainedModel",
        ],
    },
    "DiffForTokenClassification": {
        "<class>": [
            "- bases: GenericForTokenClassification, DiffPreTrainedModel",
            "+ bases: _TaskHeadHooks, GenericForTokenClassification, DiffPreTrainedModel",
        ],
    },
    "DiffForQuestionAnswering": {
        "<class>": [
            "- bases: GenericForQuestionAnswering, DiffPreTrainedModel",
            "- base_model_prefix = 'transformer'",
            "+ bases: _TaskHeadHooks, GenericForQuestionAnswering, DiffPreTrainedModel",
        ],
    },
    "DiffConfig": {
        "<class>": [
            "- model_type = 'llama'",
            "+ model_type = 'diff'",
            "- num_attention_heads: int = 32",
            "+ num_attention_heads: int = 16",
            "+ head_dim: int | None = None",
            "- initializer_range: float = interval(min=0.0, max=1.0)(default=0.02)",
            "+ initializer_range: float = 0.02",
            "- pretraining_tp: int | None = 1",
            "- head_dim: int | None = None",
            "+ diff_version: int = 2",
            "+ lambda_init: float | None = None",
            "+ lambda_std: float = 0.1",
            "+ lambda_floor: float | None = None",
            "+ attention_out_bias: bool | None = None",
            "+ use_qk_norm: bool = False",
            "+ num_noise_heads: int | None = None",
            "+ lambda_init_depth_offset: int = 0",
            "+ subln_eps: float | None = None",
            "+ conversion: dict | None = None",
        ],
        "__post_init__": Own("6a8e0fe53c0b"),
        "validate_architecture": Own("69ed30ade3da"),
        "validate_values": OURS_ONLY,
        "validate_motif_options": OURS_ONLY,
        "lambda_init_for_layer": OURS_ONLY,
        "from_dict": OURS_ONLY,  # a config.json without diff_version loads as V1 (the default before V2)
    },
}


# ---- normalisation ----


class _Normalise(ast.NodeTransformer):
    def _definition(self, node):
        self.generic_visit(node)
        node.decorator_list = [d for d in node.decorator_list if _name(d) != "auto_docstring"]  # documentation only
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        node.body = body or [ast.Pass()]
        return node

    def visit_ClassDef(self, node):
        return self._definition(node)

    def visit_FunctionDef(self, node):
        node = self._definition(node)
        node.returns = None
        arguments = node.args
        for argument in (
            *arguments.posonlyargs,
            *arguments.args,
            *arguments.kwonlyargs,
            arguments.vararg,
            arguments.kwarg,
        ):
            if argument is not None:
                argument.annotation = None
        for statement in ast.walk(node):  # a local's annotation (`x: T = ...`) is a hint, not a statement of its own
            for field, value in ast.iter_fields(statement):
                if isinstance(value, list):
                    setattr(statement, field, [_plain(item) for item in value])
        return node


def _name(decorator) -> str:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return target.id if isinstance(target, ast.Name) else ""


def _plain(node):
    if isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
        return ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)
    return node


def _lines(node) -> list[str]:
    return ast.unparse(node).splitlines()


def parts(source: str) -> dict[str, list[str]]:
    """A class's or function's source as parts of normalised lines: "<class>" (bases, decorators, class attributes)
    and one per method; a function is one part, its own name."""
    node = _Normalise().visit(ast.parse(textwrap.dedent(source)).body[0])
    if isinstance(node, ast.FunctionDef):
        return {node.name: _lines(node)}
    result = {"<class>": [f"bases: {', '.join(ast.unparse(base) for base in node.bases)}"]}
    result["<class>"] += [f"@{ast.unparse(d)}" for d in node.decorator_list]
    for statement in node.body:
        if isinstance(statement, ast.FunctionDef):
            result[statement.name] = _lines(statement)
        elif not isinstance(statement, ast.Pass) and not (
            isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)  # `...`
        ):
            result["<class>"] += _lines(statement)
    return {part: [line.replace("Llama", "Diff") for line in lines] for part, lines in result.items()}


def fingerprint(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def difference(llama: list[str], ours: list[str]) -> list[str]:
    """The lines that differ, per changed block Llama's ("- ") then ours ("+ "), without indentation."""
    lines = []
    for _, i1, i2, j1, j2 in difflib.SequenceMatcher(None, llama, ours, autojunk=False).get_opcodes():
        if i2 - i1 != j2 - j1 or llama[i1:i2] != ours[j1:j2]:
            lines += [f"- {line.strip()}" for line in llama[i1:i2]] + [f"+ {line.strip()}" for line in ours[j1:j2]]
    return lines


def _matches(expected: str, actual: str) -> bool:
    if expected.startswith("+ ") and expected.endswith("..."):
        return actual.startswith(expected[:-3])
    return expected == actual


def problems(name: str, llama_parts: dict, our_parts: dict, expected) -> list[str]:
    """What differs from INTENDED[name], one message per part (empty: the mirror is as intended)."""
    if not isinstance(expected, dict):  # a method marker: one part
        (part,) = llama_parts
        expected = {part: expected}
    found = []
    for part in sorted(set(llama_parts) | set(our_parts)):
        llama, ours, wanted = llama_parts.get(part), our_parts.get(part), expected.get(part, [])
        where = f"{name} ({part})"
        if wanted == OURS_ONLY:
            if llama is not None:
                found.append(f"{where}: Llama has it now:\n" + "\n".join(llama))
        elif isinstance(wanted, Own):
            if llama is None or fingerprint(llama) != wanted.llama_hash:
                found.append(
                    f"{where}: Llama's changed upstream (fingerprint {fingerprint(llama or [])}, expected "
                    f"{wanted.llama_hash}); review ours against it, then update the fingerprint:\n"
                    + "\n".join(llama or [])
                )
        elif isinstance(wanted, Elsewhere):
            pass  # checked by those markers (test_every_mirror_is_marked_and_listed checks they exist)
        else:
            actual = difference(llama or [], ours or [])
            if len(actual) != len(wanted) or not all(map(_matches, wanted, actual)):
                found.append(f"{where} differs from Llama's other than INTENDED says; now:\n" + "\n".join(actual))
    return found


# ---- markers ----


def markers() -> dict[str, tuple[object, str]]:
    """Our qualified name -> (our object, the dotted path its `# Mirrors` comment names), in both checkpoint files."""
    found = {}
    for module in CHECKPOINT_FILES:
        source = inspect.getsource(module)
        lines = source.splitlines()

        def visit(node, prefix, owner):
            for child in node.body:
                if not isinstance(child, (ast.ClassDef, ast.FunctionDef)):
                    continue
                qualname = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                above = first - 2  # 0-based index of the line above the definition
                while above >= 0 and lines[above].strip().startswith("#"):
                    match = MARKER.search(lines[above])
                    if match:
                        found[qualname] = (getattr(owner, child.name), match.group(1))
                    above -= 1
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{qualname}.", getattr(owner, child.name))

        visit(ast.parse(source), "", module)
    return found


def resolve(path: str):
    """`transformers.models.llama.modeling_llama.LlamaAttention.forward` -> the object."""
    names = path.split(".")
    for split in range(len(names), 0, -1):
        try:
            target = importlib.import_module(".".join(names[:split]))
        except ImportError:
            continue
        for attribute in names[split:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(path)


MARKED = markers()


def test_every_mirror_is_marked_and_listed():
    assert sorted(MARKED) == sorted(INTENDED), "a `# Mirrors` marker was added or removed: update INTENDED"
    for name, expected in INTENDED.items():
        for wanted in expected.values() if isinstance(expected, dict) else [expected]:
            if isinstance(wanted, Elsewhere):
                target = MARKED[name][1]
                for mirror in wanted.mirrors:
                    assert mirror in MARKED and MARKED[mirror][1].startswith(f"{target}."), (name, mirror)


@pytest.mark.parametrize("name", sorted(MARKED))
def test_mirror_matches_llama_but_for_the_intended_differences(name):
    ours, path = MARKED[name]
    found = problems(name, parts(inspect.getsource(resolve(path))), parts(inspect.getsource(ours)), INTENDED[name])
    assert not found, "\n\n".join(found)


def test_the_canary_fails_when_either_side_changes():
    """The comparison itself, on edited copies of the sources: a statement added to ours, one removed from Llama's,
    one changed inside a line that already differs, and a change to a method whose Llama side is only pinned."""
    _, path = MARKED["DiffDecoderLayer"]
    llama = inspect.getsource(resolve(path))
    ours = inspect.getsource(modeling_diff.DiffDecoderLayer)
    assert not problems("DiffDecoderLayer", parts(llama), parts(ours), INTENDED["DiffDecoderLayer"])

    drifted = ours.replace(
        "        hidden_states = residual + hidden_states\n", "        hidden_states = hidden_states\n", 1
    )
    assert drifted != ours
    assert problems("DiffDecoderLayer", parts(llama), parts(drifted), INTENDED["DiffDecoderLayer"])

    upstream = llama.replace("        self.hidden_size = config.hidden_size\n", "", 1)
    assert upstream != llama
    assert problems("DiffDecoderLayer", parts(upstream), parts(ours), INTENDED["DiffDecoderLayer"])

    attention = inspect.getsource(resolve(MARKED["DiffAttention"][1]))
    ours_attention = inspect.getsource(modeling_diff.DiffAttention)
    assert not problems("DiffAttention", parts(attention), parts(ours_attention), INTENDED["DiffAttention"])
    changed = attention.replace("bias=config.attention_bias", "bias=False", 1)  # inside a line that already differs
    assert changed != attention
    assert problems("DiffAttention", parts(changed), parts(ours_attention), INTENDED["DiffAttention"])

    forward = inspect.getsource(resolve(MARKED["DiffAttentionV1.forward"][1]))
    ours_v1 = inspect.getsource(modeling_diff.DiffAttentionV1.forward)
    assert not problems("DiffAttentionV1.forward", parts(forward), parts(ours_v1), INTENDED["DiffAttentionV1.forward"])
    pinned = forward.replace("        return attn_output, attn_weights\n", "        return attn_output, None\n", 1)
    assert pinned != forward
    assert problems("DiffAttentionV1.forward", parts(pinned), parts(ours_v1), INTENDED["DiffAttentionV1.forward"])
