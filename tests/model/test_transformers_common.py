"""transformers' own common model tests (`ModelTesterMixin`, `ConfigTester`) against both Diff versions.

A model inside transformers is held to these tests (about 160 per version here); a Diff model should pass them too.
They come from the `tests/` directory of the transformers *sdist* matching the installed version, downloaded from PyPI
with pip the first time this file is collected and cached in `.pytest_cache/transformers-sdist/<version>/` (nothing of
it is copied into this repository). Offline, `DIFF_TRANSFORMERS_SDIST=/path/to/transformers-<version>.tar.gz` is used
instead of PyPI. Without either, collecting this file fails with one message saying so: CI must not go green
without these tests having run; a developer offline leaves them out with
`--ignore=tests/model/test_transformers_common.py`.

The sdist ships only the top-level `tests/*.py` files, not the sub-packages that `test_modeling_common.py` and
`test_configuration_common.py` import from. Three names are therefore provided here, each said for what it is:
`ExportTesterMixin` (export tests: none run), `GenerationTesterMixin` (generate tests: none run from transformers;
`tests/model/test_generation.py` covers `generate` against a Llama-style reference) and `config_common_kwargs` (written
here: one non-default value per `PreTrainedConfig` field, checked for completeness below).
"""

import dataclasses
import functools
import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import unittest
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

from diff_transformer import DiffConfig, DiffForCausalLM, DiffModel
from tests.helpers import REPOSITORY


PACKAGE = "transformers_sdist_tests"
CACHE = REPOSITORY / ".pytest_cache" / "transformers-sdist"


def _pip_download_sdist(version: str, dest: str) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"transformers=={version}",
        "--dest",
        dest,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    archives = list(Path(dest).glob(f"transformers-{version}.tar.gz"))
    if result.returncode != 0 or len(archives) != 1:
        why = (result.stderr.strip().splitlines() or ["no sdist was downloaded"])[-1]
        raise RuntimeError(
            f"transformers' common model tests need the transformers=={version} sdist from PyPI, and `pip download "
            f"--no-deps --no-binary :all: transformers=={version}` failed ({why}). Offline: set "
            "DIFF_TRANSFORMERS_SDIST to a copy of that .tar.gz, or leave these tests out with "
            "--ignore=tests/model/test_transformers_common.py."
        )
    return archives[0]


def _extract_sdist_tests(version: str, target: Path) -> None:
    """Extract the sdist's tests/ into target, atomically: a half-extracted cache is never used."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        archive = os.environ.get("DIFF_TRANSFORMERS_SDIST") or _pip_download_sdist(version, tmp)
        prefix = f"transformers-{version}/tests/"
        with tarfile.open(archive) as sdist:
            members = [m for m in sdist.getmembers() if m.name.startswith(prefix) and m.isfile()]
            for member in members:
                member.name = member.name[len(prefix) :]
                if Path(member.name).is_absolute() or ".." in Path(member.name).parts:
                    raise RuntimeError(f"{archive}: refusing to extract {member.name!r} (outside tests/)")
            # Regular files under tests/ only; the "data" filter (Python >= 3.10.12) also drops odd permissions.
            extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            sdist.extractall(Path(tmp) / "tests", members=members, **extra)
        tests = Path(tmp) / "tests"
        if not (tests / "test_modeling_common.py").is_file():
            raise RuntimeError(f"{archive} has no {prefix}test_modeling_common.py: not the transformers sdist")
        # The repository's tests/ is a package (empty __init__.py, not shipped in the sdist): test_configuration_common
        # imports it through `direct_transformers_import(Path(__file__).parent)`.
        (tests / "__init__.py").touch()
        try:
            os.rename(tests, target)
        except OSError:  # another pytest process extracted it meanwhile
            if not (target / "test_modeling_common.py").is_file():
                raise


def _import_upstream_tests():
    """Import transformers' test_modeling_common / test_configuration_common as package `PACKAGE`."""
    version = transformers.__version__
    tests = CACHE / version / "tests"
    if not (tests / "test_modeling_common.py").is_file():
        _extract_sdist_tests(version, tests)

    def module(name, **attributes):
        mod = types.ModuleType(name)
        mod.__dict__.update(attributes)
        sys.modules[name] = mod
        return mod

    module(PACKAGE, __path__=[str(tests)])
    # Sub-packages the sdist does not ship (see the module docstring).
    module(f"{PACKAGE}.exporters", __path__=[])
    module(f"{PACKAGE}.exporters.test_export", ExportTesterMixin=type("ExportTesterMixin", (), {}))
    module(f"{PACKAGE}.generation", __path__=[])
    module(f"{PACKAGE}.generation.test_utils", GenerationTesterMixin=type("GenerationTesterMixin", (), {}))
    module(f"{PACKAGE}.utils", __path__=[])
    module(f"{PACKAGE}.utils.test_configuration_utils", config_common_kwargs=CONFIG_COMMON_KWARGS)
    with warnings.catch_warnings():  # their marks (flash_attn_test, ...) are registered in transformers' pyproject
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        modeling = importlib.import_module(f"{PACKAGE}.test_modeling_common")
        configuration = importlib.import_module(f"{PACKAGE}.test_configuration_common")
    return modeling, configuration


# A non-default value for every field `PreTrainedConfig` itself defines (checked by the test below), as
# `ConfigTester.check_config_arguments_init` expects: it builds the config from these and checks each one stuck.
CONFIG_COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",  # check_config_arguments_init compares dtype with torch.float16
    "chunk_size_feed_forward": 3,
    "architectures": ["DiffForCausalLM"],
    "id2label": {0: "first", 1: "second"},
    "label2id": {"first": 0, "second": 1},
    "problem_type": "single_label_classification",
}


modeling_common, configuration_common = _import_upstream_tests()
ModelTesterMixin, ConfigTester, ids_tensor = (
    modeling_common.ModelTesterMixin,
    configuration_common.ConfigTester,
    modeling_common.ids_tensor,
)


class DiffModelTester:
    """Builds the tiny configs and inputs transformers' mixins ask for (as LlamaModelTester does for Llama)."""

    def __init__(self, parent, diff_version):
        self.parent, self.diff_version = parent, diff_version
        self.batch_size, self.seq_length = 3, 7
        self.is_training = True
        self.vocab_size = 99
        self.hidden_size = 32
        self.num_hidden_layers = 2
        self.num_attention_heads = 2  # differential heads: 4 query sub-heads of size head_dim
        self.num_key_value_heads = 1
        self.head_dim = 8
        self.intermediate_size = 37
        self.max_position_embeddings = 512
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2

    def get_config(self):
        return DiffConfig(
            diff_version=self.diff_version,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            hidden_act="gelu",
            max_position_embeddings=self.max_position_embeddings,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))  # right padding of every length, as Llama's tester
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class DiffModelTestBase(ModelTesterMixin):
    diff_version = None
    all_model_classes = (DiffModel, DiffForCausalLM)

    @classmethod
    def setUpClass(cls):
        # The mixins pick inputs and labels by class name from transformers' auto-model name tables (a base model gets
        # no labels, a causal LM gets token labels). A model inside transformers is listed there; so is Diff, for the
        # duration of these tests.
        cls._listed = [
            mock.patch.dict(modeling_auto.MODEL_MAPPING_NAMES, diff="DiffModel"),
            mock.patch.dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, diff="DiffForCausalLM"),
        ]
        for patch in cls._listed:
            patch.start()

    @classmethod
    def tearDownClass(cls):
        for patch in cls._listed:
            patch.stop()

    def setUp(self):
        self.model_tester = DiffModelTester(self, self.diff_version)
        self.config_tester = ConfigTester(
            self, config_class=DiffConfig, hidden_size=48, num_attention_heads=4, diff_version=self.diff_version
        )

    def test_config(self):
        self.config_tester.run_common_tests()

    @unittest.skip(
        "GenerationTesterMixin lives in tests/generation/, which the transformers sdist does not ship; generate "
        "is tested in tests/model/test_generation.py"
    )
    def test_generation_tester_mixin_inheritance(self):
        pass


# The fp16/bf16 eager-vs-SDPA cases (16 of the 25 per version) take about a third of this file's CPU time; the fp32
# cases check the same dispatch, padding and masking at a tight tolerance. The low-precision ones are marked slow.
for _name, _test in vars(ModelTesterMixin).items():
    if _name.startswith("test_eager_matches_sdpa_inference_") and ("_fp16_" in _name or "_bf16_" in _name):
        _wrapped = functools.wraps(_test)(lambda self, _test=_test: _test(self))
        setattr(DiffModelTestBase, _name, pytest.mark.slow(_wrapped))


class DiffV1ModelTest(DiffModelTestBase, unittest.TestCase):
    diff_version = 1


class DiffV2ModelTest(DiffModelTestBase, unittest.TestCase):
    diff_version = 2


def test_config_common_kwargs_cover_every_pretrained_config_field():
    """The stand-in for transformers' `config_common_kwargs` must not go stale when transformers adds a field."""
    from transformers import PreTrainedConfig

    fields = {f.name: f for f in dataclasses.fields(PreTrainedConfig)}
    expected = set(fields) - {"transformers_version", "is_encoder_decoder"} | {"output_attentions"}
    assert set(CONFIG_COMMON_KWARGS) == expected
    defaults = PreTrainedConfig()
    assert not [key for key, value in CONFIG_COMMON_KWARGS.items() if getattr(defaults, key) == value]
