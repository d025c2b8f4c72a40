"""Issue 56, item 1: concurrent requests across more models than --max-loaded-models. transformers' model manager
locks per model, so two models were built at once (`from_pretrained` is not thread-safe: the tied lm_head was left
uninitialised) and a model was unloaded under a request's feet: 6 of 8 answers garbage with HTTP 200, later ones too.

`DiffModelManager` builds and drops models under one lock and pins a model while a request uses it; here concurrent
clients (threads) ask for three models through a server that holds one, and every answer must equal greedy `generate`
of the same model, one request at a time."""

import concurrent.futures
import threading
import time

import pytest

from diff_transformer.serving import models as serving_models
from diff_transformer.serving.patches import ServeSettings
from tests.helpers.server import Server
from tests.serving import fixtures
from tests.serving.fixtures import CHATS, NEW_TOKENS


models, references = fixtures.models, fixtures.references
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_builds_never_overlap_and_pinned_models_are_never_unloaded(models, capsys):
    """The manager alone, threads calling it as the server's worker threads do: with room for one model, no two
    builds run at once, a model a request pinned stays loaded (a load of another waits for its release), and every
    model handed out is the whole model (its tied lm_head is its embedding). Each load and unload says so in one
    line on stderr (issue 57 item 2: a load is minutes of silence in a log otherwise), which --quiet silences."""
    manager = serving_models.diff_model_manager(ServeSettings(max_loaded_models=1))(device="cpu", model_timeout=-1)
    building, overlaps, order = [0], [], []
    guard = threading.Lock()
    original = type(manager)._load_model  # the class `diff_model_manager` made for this manager alone

    def counted(self, key, *args, **kwargs):
        with guard:
            building[0] += 1
            overlaps.append(building[0])
            order.append(key)
        try:
            time.sleep(0.05)  # widen the window a second build would need
            return original(self, key, *args, **kwargs)
        finally:
            with guard:
                building[0] -= 1

    type(manager)._load_model = counted
    try:
        keys = [f"{models[name]}@main" for name in ("v2", "v1", "saved")]
        first, _, release_first = manager.acquire(keys[0])
        waiting = concurrent.futures.ThreadPoolExecutor(1).submit(manager.acquire, keys[1])
        time.sleep(0.5)
        assert not waiting.done()  # the only place is pinned: the load of another model waits
        assert list(manager.loaded_models) == [keys[0]] and first.lm_head.weight is not None
        release_first()
        release_first()  # idempotent
        second, _, release_second = waiting.result(timeout=120)
        assert list(manager.loaded_models) == [keys[1]]
        release_second()

        def use(key):
            model, _, release = manager.acquire(key)
            try:
                tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
                return key, tied or not model.config.tie_word_embeddings, model.lm_head.weight.abs().max().item()
            finally:
                release()

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(use, [keys[i % 3] for i in range(12)]))
        assert max(overlaps) == 1, overlaps  # never two builds at once
        assert all(tied and maximum < 1e4 for _, tied, maximum in results), results
        assert len(manager.loaded_models) == 1 and not manager._pins
        lines = capsys.readouterr().err.splitlines()
        loading = [line for line in lines if line.startswith("diff-transformer serve: loading model ")]
        loaded = [line for line in lines if line.startswith("diff-transformer serve: loaded model ")]
        unloaded = [line for line in lines if line.startswith("diff-transformer serve: unloaded model ")]
        assert len(loading) == len(loaded) == len(order) and len(unloaded) == len(order) - 1, lines
        assert loading[0] == f"diff-transformer serve: loading model {str(models['v2'])!r}"
        settings = ServeSettings(max_loaded_models=1, model_wait_s=0.3)
        busy = serving_models.diff_model_manager(settings)(device="cpu", model_timeout=-1)
        release_busy = busy.acquire(keys[0])[2]
        with pytest.raises(Exception) as caught:  # the one place pinned past model_wait_s: a 503, not a hang
            busy.acquire(keys[1])
        assert caught.value.status_code == 503 and "every loaded model is in use" in caught.value.detail["message"]
        release_busy()
        busy.shutdown()
        capsys.readouterr()
        quiet = serving_models.diff_model_manager(ServeSettings(quiet=True))(device="cpu", model_timeout=-1)
        quiet.acquire(keys[0])[2]()
        quiet.shutdown()
        assert "diff-transformer serve" not in capsys.readouterr().err
    finally:
        type(manager)._load_model = original
        manager.shutdown()


def test_trust_remote_code_still_serves_a_diff_model_with_the_package_s_classes(models):
    """`serve --trust-remote-code` (for another family's custom code) leaves a Diff checkpoint on the package's
    classes, as transformers' loader did (it looked the class up by name): the Auto classes prefer the registered
    class to the copy of modeling_diff.py saved with the weights, in V1 and V2."""
    from diff_transformer.modeling_diff import DiffForCausalLM

    manager = serving_models.diff_model_manager(ServeSettings(quiet=True))(
        device="cpu", model_timeout=-1, trust_remote_code=True
    )
    for name in ("v2", "v1"):
        model = manager._load_model(f"{models[name]}@main")
        assert type(model) is DiffForCausalLM and model.config.diff_version == int(name[1]), name


def test_a_load_failure_s_advice_fits_its_cause(models, tmp_path):
    """A load that fails for a reason other than the files (here an attention backend that is not installed) is a
    400 with transformers' reason and no "re-download it" advice (which the road gave every failure); a checkpoint
    whose weights file is missing still gets it. Meanwhile a Llama (not a Diff model) loads as transformers' server
    loads it."""
    import shutil

    from transformers import LlamaForCausalLM

    from diff_transformer.checkpoints.loading import from_pretrained
    from diff_transformer.errors import UserError

    flash = serving_models.diff_model_manager(ServeSettings(quiet=True))(
        device="cpu", model_timeout=-1, attn_implementation="flash_attention_2"
    )
    with pytest.raises(Exception) as caught:
        flash.acquire(f"{models['v2']}@main")
    message = caught.value.detail["message"]
    assert caught.value.status_code == 400 and "flash" in message.lower() and "re-download" not in message, message
    broken = tmp_path / "broken"
    shutil.copytree(models["v2"], broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(UserError, match="check that it is a complete checkpoint, or re-download it"):
        from_pretrained(str(broken), "MODEL 'broken'")
    llama = serving_models.diff_model_manager(ServeSettings(quiet=True))(device="cpu", model_timeout=-1)
    assert type(llama._load_model(f"{fixtures.TINY_LLAMA}@main")) is LlamaForCausalLM


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module, holding one model at a time."""
    logs = tmp_path_factory.mktemp("serve")
    started = Server(logs / "serve.log", "--max-loaded-models", "1", "--max-queued-requests", "16")
    try:
        started.wait_healthy()
        yield started
    finally:
        started.stop()


@pytest.mark.slow
def test_concurrent_chats_across_models_answer_as_one_at_a_time(server, models, references):
    """9 concurrent chats (3 models, plain and streamed) through a server that holds one model: each answer equals
    greedy `generate` of its model, and so does each model's answer afterwards, one request at a time (the corrupted
    models of the race kept answering garbage until a restart)."""
    names = ("v2", "v1", "saved")
    jobs = [(names[i % 3], CHATS[(i // 3) % 3], i % 2 == 1) for i in range(9)]

    def chat(name, messages, stream):
        kwargs = dict(model=str(models[name]), messages=messages, max_tokens=NEW_TOKENS, temperature=0)
        client = server.client()
        if not stream:
            response = client.chat.completions.create(**kwargs)
            return response.choices[0].message.content, response.usage.completion_tokens
        pieces, usage = [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        return "".join(pieces), usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: chat(*job), jobs))
    wrong = [(job, answer) for job, answer in zip(jobs, answers) if answer != references(job[0], job[1])]
    assert not wrong, f"{len(wrong)} of {len(jobs)} differ from greedy generate: {wrong[:2]}\n{server.log_tail()}"
    for name in names:
        assert chat(name, CHATS[0], False) == references(name, CHATS[0])
