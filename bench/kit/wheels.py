"""What the device kit needs on the GPU machine beyond what its image has: pinned wheels, and the image's
own packages (the clean-venv test builds exactly that environment).

    WHEELS            (distribution, version, file name, sha256): downloaded by scripts/device_wheels.py
                      into wheels/ (ignored by git), carried with the tree, installed there with
                      `pip install --no-index --no-deps --target` before the kit runs
    MACHINE_PACKAGES  the distributions the kit may use from the image (docs/PERFORMANCE.md, "How to run
                      the GPU check"): torch and what it needs, numpy, safetensors, onnx, onnxruntime
                      (CPU), pyyaml, prometheus-client, httpx, tqdm, scipy, einops
    ABSENT            what the image does not have and the kit's import path must never need

Why each wheel: soundfile (+ cffi, pycparser) because `app.audio` reads and writes audio with it and the
bench's voices are normalised there; s3tokenizer because `app.voices.features` takes its log-mel; the
reference (`stepaudio2-minicpmo`, its flow and HiFT) with HyperPyYAML and ruamel.yaml, which build it from
flow.yaml. The reference's package `__init__` (its LLM side: transformers, librosa) is never run
(`bench.engine.reference.reference_loader`). Targets: CPython 3.12, manylinux x86_64 (py3-none-any
where the project publishes one). No torch import here.
"""

from __future__ import annotations

from typing import NamedTuple


class Wheel(NamedTuple):
    name: str
    version: str
    file: str
    sha256: str


WHEELS = (
    Wheel("stepaudio2-minicpmo", "0.1.1", "stepaudio2_minicpmo-0.1.1-py3-none-any.whl",
          "7bf176cdadedabca30f4abb1fa49b7514981fbc8f763314fa811c2e4160a4523"),
    Wheel("HyperPyYAML", "1.2.3", "hyperpyyaml-1.2.3-py3-none-any.whl",
          "0088c8ce97dc7c7d3460112b6ccc92dca46fade4d0320bc39f58b1fdda60f7f1"),
    Wheel("ruamel.yaml", "0.18.17", "ruamel_yaml-0.18.17-py3-none-any.whl",
          "9c8ba9eb3e793efdf924b60d521820869d5bf0cb9c6f1b82d82de8295e290b9d"),
    Wheel("s3tokenizer", "0.3.0", "s3tokenizer-0.3.0-py3-none-any.whl",
          "c9e93b1892a124a2c4d958ab53610a1b4433fcb4172056e2f2bd3c09cfe249a6"),
    Wheel("soundfile", "0.14.0", "soundfile-0.14.0-py2.py3-none-manylinux_2_28_x86_64.whl",
          "1e38bac1853412871318e82a1ba69a8be677619b56025bbfcccdb41b6cafe82d"),
    Wheel("cffi", "2.1.1", "cffi-2.1.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
          "c1453022f490d2459a11819d83ad1d586e9ff65a12ac3e705ffebd46d3685dcf"),
    Wheel("pycparser", "3.12", "pycparser-3.12-py3-none-any.whl",
          "a076f3f489b39b43ed13563a1dafe42447445bec2e294154ec5c57fcdda4c85e"),
)

# The image's distributions the kit's import path may use (KINDS.md's list, the part that matters here).
MACHINE_PACKAGES = (
    "torch", "torchaudio", "numpy", "safetensors", "onnx", "onnxruntime", "protobuf", "PyYAML",
    "prometheus-client", "httpx", "tqdm", "scipy", "einops", "packaging",
)  # with what they require (the image has that too): the clean-venv test follows their requirements

ABSENT = ("celery", "kombu", "redis", "sqlalchemy", "alembic", "pydantic", "pydantic_settings", "tensorrt",
          "librosa", "transformers", "fastapi")

WHEELS_DIR = "wheels"
INSTALL_TARGET = "/tmp/kit-site"
