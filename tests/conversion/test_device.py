"""`convert --device` / `device=` (conversion/device.py): where V1's calibration and `verify_conversion` compute.
On the CPU the output must be the bytes it always was; a bad device is refused before anything is read; the
calibration holds one decoder layer at a time and hands back what the writer writes (CPU, SRC's dtype)."""

import gc
import weakref

import pytest
import torch

from diff_transformer.conversion import ConversionError, calibrate, convert_to_diff, fit, verify_conversion
from tests.conversion.test_v1_init import TINY_LLAMA
from tests.helpers.checkpoints import make_llama, tree_digest
from tests.helpers.motif import write_motif_checkpoint


SMALL = dict(calibration_blocks=2, calibration_block_size=32)  # sampled text: enough to fit a 192-wide layer


@pytest.mark.parametrize(
    "device, words",
    [
        ("tpu", ("--device", "'tpu'", "cpu, cuda")),
        ("cuda:x", ("--device", "cuda:x")),
        ("mps", ("--device mps", "float64", "--device cpu")),
        ("cuda", ("--device cuda", "no CUDA", "--device cpu")),
    ],
)
def test_a_bad_device_is_refused_before_anything_is_read(tmp_path, refused, monkeypatch, device, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU, wherever run
    missing = tmp_path / "no-such-checkpoint"  # were SRC read first, the error would name it instead
    refused(["convert", missing, tmp_path / "out", "--device", device], *words)
    refused(["convert", missing, tmp_path / "out", "--diff-version", "1", "--verify", "--device", device], *words)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConversionError, match="--device"):
        convert_to_diff(missing, tmp_path / "out", device=device)
    with pytest.raises(ConversionError, match="--device"):
        verify_conversion(missing, tmp_path / "out", device=device)


@pytest.mark.parametrize(
    "case",
    [
        "v1-paired",
        "v1-bf16",
        "v2",
        pytest.param("v1-expanded", marks=pytest.mark.slow),  # 4 min on a loaded 2-core machine (load 14)
        pytest.param("motif", marks=pytest.mark.slow),  # the plain-torch Motif reference runs one head at a time
    ],
)
def test_device_cpu_writes_the_same_bytes_as_no_device(tmp_path, case):
    """The default is the CPU, and asking for it changes nothing: every file of OUT is the same, byte for byte."""
    if case == "motif":
        write_motif_checkpoint(tmp_path / "src")
        src, options = tmp_path / "src", {}
    elif case == "v1-bf16":  # the fitted o_proj is kept in SRC's dtype: the same single rounding as before
        src, options = make_llama(tmp_path / "src", dtype=torch.bfloat16), dict(diff_version=1, **SMALL)
    elif case == "v2":
        src, options = TINY_LLAMA, dict(diff_version=2)
    else:
        src, options = TINY_LLAMA, dict(diff_version=1, v1_layout=case.split("-")[1], **SMALL)
    # the same name (the model card names OUT), in two folders
    plain = convert_to_diff(src, tmp_path / "plain" / "out", progress=False, **options)
    on_cpu = convert_to_diff(src, tmp_path / "cpu" / "out", progress=False, device="cpu", **options)
    assert tree_digest(plain) == tree_digest(on_cpu)
    if case in ("v2", "motif"):  # exact conversions: verified on the CPU device as without one
        options = dict(num_sequences=2, max_new_tokens=4)
        report = verify_conversion(src, on_cpu, device="cpu", **options)
        assert report == verify_conversion(src, plain, **options)
        assert report["passed"] is True


def test_calibration_holds_one_layer_at_a_time_and_returns_what_is_written(tmp_path, monkeypatch):
    """Each decoder layer built by the calibration is freed before the next one is loaded, and the fitted o_proj
    come back on the CPU in the dtype SRC stores (bfloat16 here), not as float32 copies of every layer."""
    src = make_llama(tmp_path / "src", dtype=torch.bfloat16, num_hidden_layers=3)
    alive, loaded = [], []
    load = fit._load_layer

    def tracked(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in loaded))
        layer = load(*args, **kwargs)
        loaded.append(weakref.ref(layer))
        return layer

    monkeypatch.setattr(fit, "_load_layer", tracked)
    seen = {}
    calibrate_v1_start = calibrate.calibrate_v1_start

    def keep(*args, **kwargs):
        seen["start"] = calibrate_v1_start(*args, **kwargs)
        return seen["start"]

    monkeypatch.setattr(calibrate, "calibrate_v1_start", keep)
    convert_to_diff(src, tmp_path / "out", diff_version=1, progress=False, device="cpu", **SMALL)
    assert alive == [0, 0, 0]  # no earlier layer alive when the next one loads
    weights = seen["start"].output_weights
    assert sorted(weights) == [0, 1, 2]
    assert all(w.dtype == torch.bfloat16 and w.device.type == "cpu" for w in weights.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_checks.sh runs it)")
@pytest.mark.parametrize("case", ["v1-paired", "v1-expanded", "v2", "motif"])
def test_calibration_and_verify_on_cuda(tmp_path, case):
    """On a GPU: the exact conversions verify there (and are the CPU's bytes: nothing is fitted); V1 fitted there on
    the same text (a file: no sampling, whose RNG differs by device) starts where the CPU's fit does, up to the
    float32 rounding of the two devices' kernels (measured held-out ratio within 1e-3 of the CPU's)."""
    import json

    if case == "motif":
        write_motif_checkpoint(tmp_path / "src")
        src, options = tmp_path / "src", {}
    elif case == "v2":
        src, options = TINY_LLAMA, dict(diff_version=2)
    else:
        text = calibrate.BUILTIN_TEXT
        src, options = TINY_LLAMA, dict(diff_version=1, v1_layout=case.split("-")[1], calibration_data=text)
    out = convert_to_diff(src, tmp_path / "cuda" / "out", progress=False, device="cuda", **options)
    cpu = convert_to_diff(src, tmp_path / "cpu" / "out", progress=False, **options)
    report = verify_conversion(src, out, device="cuda")
    if case in ("v2", "motif"):
        assert report["passed"] is True
        assert tree_digest(out) == tree_digest(cpu)
        return
    records = [json.loads((path / "config.json").read_text())["conversion"] for path in (out, cpu)]
    assert records[0]["calibration_device"] == "cuda" and "calibration_device" not in records[1]
    ratios = [record["step0_heldout"]["ratio"] for record in records]
    assert abs(ratios[0] - ratios[1]) <= 1e-3 * ratios[1], ratios
