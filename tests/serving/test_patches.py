"""The patches `diff-transformer serve` makes to transformers' server (`serving.patches.PATCHES`), one test each: it
fails when the internal of the pinned transformers (or uvicorn) that the patch relies on changes, in name, signature
or in the call the patch needs. Then the table itself: every patch names its test here, `install` applies every
patch (in a subprocess: the patches change transformers for the process), and applying twice does not stack."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

from transformers.cli import serve as transformers_serve
from transformers.cli.serving import chat_completion, completion, model_manager, response, systemone, utils

from diff_transformer.serving.patches import GUARD, PATCHES, patch_table


HANDLERS = (
    chat_completion.ChatCompletionHandler,
    completion.CompletionHandler,
    response.ResponseHandler,
    systemone.SystemOneHandler,
)


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def source(function) -> str:
    return inspect.getsource(function)


def test_model_manager_internals():
    """`DiffModelManager` subclasses transformers' manager and calls its loaders itself (under one lock)."""
    manager = model_manager.ModelManager
    assert "from .serving.model_manager import ModelManager" in source(transformers_serve.Serve.__init__)
    keywords = {"device", "dtype", "trust_remote_code", "attn_implementation", "continuous_batching"}
    assert keywords | {"quantization", "model_timeout", "force_model"} <= set(parameters(manager.__init__))
    assert "self.load_model_and_processor(" in source(manager.__init__)  # the pinned model, loaded at start
    assert parameters(manager._load_processor) == ["self", "model_id_and_revision", "gguf_file"]
    assert parameters(manager._load_model) == [
        "self", "model_id_and_revision", "tqdm_class", "progress_callback", "gguf_file"
    ]  # fmt: skip
    assert parameters(manager.load_model_and_processor) == [
        "self", "model_id_and_revision", "progress_callback", "tqdm_class", "gguf_file"
    ]  # fmt: skip
    assert "self.loaded_models: dict[str, TimedModel] = {}" in source(manager.__init__)
    for kept in ("device", "dtype", "trust_remote_code", "attn_implementation"):  # what our `_load_model` reads
        assert f"self.{kept} = " in source(manager.__init__), kept
    assert parameters(manager.get_quantization_config) == ["self"]
    # Its own loader's options, which ours passes to `Checkpoint.load` (from_pretrained) the same way.
    for option in ("revision", "attn_implementation", "dtype", "device_map", "trust_remote_code", "tqdm_class"):
        assert f'"{option}": ' in source(manager._load_model), option
    timed = model_manager.TimedModel
    assert parameters(timed.__init__) == ["self", "model", "timeout_seconds", "processor", "on_unload"]
    assert "threading.Timer(self.timeout_seconds, self._timeout_reached)" in source(timed.reset_timer)
    assert "threading.Timer(self.timeout_seconds, self._timeout_reached)" in source(timed.__init__)
    assert "del self.model" in source(timed.delete_model)


def test_build_server_returns_the_app_serve_runs():
    from transformers.cli.serving import server

    assert "from .serving.server import build_server" in source(transformers_serve.Serve.__init__)
    assert "app = build_server(" in source(transformers_serve.Serve.__init__)
    assert "return app" in source(server.build_server)
    assert "chat_handler.handle_request(body, request.state.request_id)" in source(server.build_server)


def test_handlers_take_body_and_request_id():
    for handler in HANDLERS:
        assert parameters(handler.handle_request)[:3] == ["self", "body", "request_id"], handler
    assert "self.model_manager.load_model_and_processor(" in source(utils.BaseHandler._resolve_model)
    assert "model_manager" in parameters(utils.BaseHandler.__init__)


def test_handlers_validate_first():
    """`check_request` runs inside `_validate_request`, which each handler calls before it loads or generates."""
    assert parameters(utils.BaseHandler._validate_request) == ["self", "body"]
    for handler in (chat_completion.ChatCompletionHandler, completion.CompletionHandler, response.ResponseHandler):
        text = source(handler.handle_request)
        assert "self._validate_request(body)" in text, handler
        assert text.index("self._validate_request(body)") < text.index("self._resolve_model(body)"), handler


def test_generate_managers_take_request_id():
    """`bounded_generation` reads (model, inputs, gen_config) positionally and the request's state by the
    `request_id` keyword the handlers pass."""
    for manager in (utils.GenerateManager, utils.CBGenerateManager):
        for name in ("generate_streaming", "generate_non_streaming"):
            assert parameters(getattr(manager, name))[:6] == [
                "self", "model", "processor", "inputs", "gen_config", "request_id"
            ], (manager, name)  # fmt: skip
    for module in (chat_completion, completion):
        assert "request_id=request_id" in inspect.getsource(module)
    assert "cancel" in dir(utils.DirectStreamer) and "cancel" in dir(utils.CBStreamer)


def test_uvicorn_config_keywords():
    import uvicorn

    assert {"timeout_graceful_shutdown", "log_level"} <= set(parameters(uvicorn.Config.__init__))
    assert "uvicorn.Config(app" in source(transformers_serve.Serve.__init__)


def test_chat_template_compiler():
    from transformers.utils import chat_template_utils

    assert parameters(chat_template_utils._cached_compile_jinja_template) == ["chat_template"]
    assert "_compile_jinja_template(" in inspect.getsource(chat_template_utils.render_jinja_template)


def test_every_patch_names_its_test_and_install_applies_each_once(tmp_path):
    """The table: each patch's guard is a test of this module; `install` (twice, with other settings the second
    time) leaves each target patched once, from the original, with the second settings."""
    here = Path(__file__).read_text()
    for patch in PATCHES:
        assert patch.guarded_by.startswith(GUARD), patch.name
        assert f"def {patch.guarded_by[len(GUARD) :]}(" in here, patch.name
        assert patch.replaces and patch.relies_on and patch.target
    script = """
import json, uvicorn
from transformers.cli.serving import chat_completion, model_manager, server, utils
from diff_transformer.serving.patches import ServeSettings, install
install(ServeSettings(max_loaded_models=2))
first = utils.GenerateManager.generate_streaming
install(ServeSettings(max_loaded_models=3, quiet=True, served=("a", "b", "c", "d")))
targets = {
    "model manager": model_manager.ModelManager.__name__ == "DiffModelManager",
    "app": hasattr(server.build_server, "_diff_original"),
    "handlers": hasattr(chat_completion.ChatCompletionHandler.handle_request, "_diff_original"),
    "request checks": hasattr(utils.BaseHandler._validate_request, "_diff_original"),
    "generation": hasattr(utils.GenerateManager.generate_non_streaming, "_diff_original"),
    "uvicorn": hasattr(uvicorn.Config.__init__, "_diff_original"),
}
from transformers.utils import chat_template_utils
targets["chat templates"] = chat_template_utils._compile_jinja_template.__name__ == "compile_bounded"
once = utils.GenerateManager.generate_streaming._diff_original is first._diff_original
config = uvicorn.Config(app=None)
print(json.dumps({"targets": targets, "once": once, "loaded": model_manager.ModelManager(device="cpu").settings
    .max_loaded_models, "log_level": config.log_level, "shutdown": config.timeout_graceful_shutdown}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["targets"] == {patch.name: True for patch in PATCHES}
    assert result["once"]  # the second install wrapped the original, not the first patch
    assert result["loaded"] == 4  # the second settings, raised to one place per MODEL served
    assert result["log_level"] == "warning" and result["shutdown"] == 5


def test_docs_show_the_patch_table():
    page = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    assert patch_table() in page
