"""The examples run: a ResNet-18 exported from PyTorch classifies with
fastconv alone and the same logits; the digits CNN learns."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np

import fastconv

REPO = pathlib.Path(fastconv.__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def run_example(script, *args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)], env=env,
                            cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_resnet18_from_torch_gives_torch_logits_without_torch(tmp_path):
    weights, reference, logits = tmp_path / "r18.npz", tmp_path / "ref.npz", tmp_path / "out.npy"
    run_example("export_torch_resnet18.py", weights, "--reference", reference,
                "--image-size", 64, "--batch", 2)
    out = run_example("resnet18_infer.py", weights, "--images", reference, "--repeat", 1,
                      "--save-logits", logits, "--report-torch")
    assert "torch in sys.modules: False" in out
    assert out.count("image ") == 2 and "ms per batch" in out
    expected = np.load(reference)["logits"]
    got = np.load(logits)
    assert got.shape == expected.shape == (2, 1000)
    assert np.abs(got - expected).max() <= 1e-3 * np.abs(expected).max()
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()


def load_train_digits():
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLES / "train_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_cnn_learns():
    history = load_train_digits().train("fastconv", epochs=3, show_progress=False,
                                        log=lambda line: None)
    assert history["loss"][-1] < 0.5 * history["loss"][0]
    assert history["test_accuracy"][-1] > 0.8  # chance is 0.1


def test_train_digits_script_with_torch_comparison():
    out = run_example("train_digits.py", "--epochs", 1, "--torch", "--no-progress")
    summary = [line for line in out.splitlines() if "s per epoch" in line]
    assert [line.split(":")[0].strip() for line in summary] == ["fastconv", "torch"]
