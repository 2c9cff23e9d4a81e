"""A GGUF file's converted directory in the cache: what the engine and the frontend read of the
file without parsing its header again, and without transformers.

Converted once per file (keyed by its path, size and mtime), in `$V1_CACHE_DIR/gguf/` (default
`~/.cache/v1/gguf/`), published by an atomic rename:

    <stem>-<key>/
        config.json            the transformers config, as its class saves it
        tokenizer.json ...     the tokenizer transformers builds from the metadata (seconds),
                               saved as plain files (well under a second to load)
        gguf_tensors.json      the record (`gguf_conversion.write_index`): where each tensor
                               lies in the file, the config's every field, the tokenizer's EOS
    <stem>-<key>-fp32/         only where float weights are asked for (`fp32_checkpoint`)
    (each holds source.json: the file, size, mtime and layout version it was converted from)

Bounded: each new conversion first removes the entries nothing can use again (their file
changed since, or converted by an older layout version; their file gone, or from before
source.json, once an hour old), so the cache holds about one entry (and its fp32 copy) per
GGUF file on the machine, however often files are replaced or v1 upgraded. A newer layout's
entries are left to the install that wrote them.

An engine loading the file reads the record alone (`recorded_config`, `recorded_eos`):
importing transformers costs ~1 s of a start (`from transformers import PretrainedConfig`,
torch already in), and an engine serving no grammar needs no tokenizer.
"""

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from v1 import envs
from v1.openmp import load_torch_passively

if TYPE_CHECKING:  # imported where a file is converted: it needs torch, a frontend does not
    from v1.models.gguf_conversion import GGUFModel

logger = logging.getLogger("v1")

# Bump when the converted layout changes, so stale cache entries are ignored (2: config,
# tokenizer and tensor index only, the fp32 weights in a directory of their own; 3: the index
# records the whole config and the tokenizer's EOS; 4: source.json, stale entries removed).
_CONVERSION_VERSION = 4
TENSOR_INDEX = "gguf_tensors.json"
SOURCE = "source.json"
# An entry without SOURCE (written before it) or a temporary directory untouched this long
# is no conversion still in progress.
_STALE_AGE_S = 3600.0

GGUFOpener = Callable[[], "GGUFModel"]


def is_gguf_conversion(model_dir: Path) -> bool:
    """Whether `model_dir` is a GGUF file's converted directory (`convert_gguf`): its files
    were written by this module, by transformers' own classes."""
    return (model_dir / TENSOR_INDEX).is_file()


def _record(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / TENSOR_INDEX).read_text())


def recorded_config(model_dir: Path) -> SimpleNamespace:
    """The converted file's config as plain attributes: every field its transformers class
    set (`to_dict()`), defaults included, so a `getattr` finds what it would on the class."""
    return SimpleNamespace(**_record(model_dir)["config"])


def recorded_eos(model_dir: Path) -> int | None:
    """The EOS id of the converted file's tokenizer (None: the file has no tokenizer)."""
    return _record(model_dir)["eos_token_id"]


def converted_dir(gguf_path: Path, part: str = "") -> Path:
    """Where the converted copy of this GGUF file lives (it may not exist yet): its config and
    tokenizer, or with `part` "fp32" its fp32 checkpoint."""
    source = _source(gguf_path)
    key = f"{source['path']}|{source['size']}|{source['mtime_ns']}|v{source['version']}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    suffix = f"-{part}" if part else ""
    return envs.read().cache_dir / "gguf" / f"{gguf_path.stem}-{digest}{suffix}"


def _source(gguf_path: Path) -> dict[str, Any]:
    """What a conversion of `gguf_path` is keyed by (and records in SOURCE)."""
    st = gguf_path.stat()
    return {"path": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "version": _CONVERSION_VERSION}


def convert_gguf(gguf_path: Path, opened: GGUFOpener | None = None) -> Path:
    """The HF directory of `gguf_path`'s config, tokenizer and tensor index (no weights),
    converting on first use; `opened` gives the file opened (`read_gguf`) where the caller
    has it."""
    opened = opened or _opener(gguf_path)
    return _converted(converted_dir(gguf_path), gguf_path,
                      lambda out: _write_config_and_tokenizer(opened(), out))


def fp32_checkpoint(gguf_path: Path, opened: GGUFOpener | None = None) -> Path:
    """A whole HF model directory for `gguf_path` (config, tokenizer, and its weights as an
    fp32 model.safetensors: 4 bytes a weight), converting on first use: for float weights
    and other libraries (transformers) only; quantization="gguf" reads the file's blocks."""
    opened = opened or _opener(gguf_path)
    meta = convert_gguf(gguf_path, opened)

    def write(out: Path) -> None:
        load_torch_passively()  # gguf_conversion imports torch (v1/openmp.py)
        from v1.models.gguf_conversion import write_hf_checkpoint

        for file in meta.iterdir():
            if file.name != TENSOR_INDEX:
                shutil.copy2(file, out / file.name)
        write_hf_checkpoint(opened(), out)

    return _converted(converted_dir(gguf_path, "fp32"), gguf_path, write)


def _opener(gguf_path: Path) -> GGUFOpener:
    def read() -> "GGUFModel":
        load_torch_passively()  # gguf_conversion imports torch (v1/openmp.py)
        from v1.models.gguf_conversion import read_gguf

        return read_gguf(gguf_path)

    return read


def hf_checkpoint_dir(path: Path) -> Path:
    """A directory transformers loads the model at `path` (resolved) from, weights and all:
    an HF model directory itself, a GGUF file's fp32 checkpoint (`fp32_checkpoint`)."""
    return fp32_checkpoint(path) if path.is_file() else path


def _converted(target: Path, gguf_path: Path, write: Callable[[Path], None]) -> Path:
    """`target`, written by `write` into a temporary directory published by an atomic rename
    unless it exists already (config.json marks a complete one)."""
    if (target / "config.json").is_file():
        return target
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_entries(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        (tmp / SOURCE).write_text(json.dumps(_source(gguf_path)))
        try:
            # Atomic: readers see either no directory or a complete one.
            os.rename(tmp, target)
            outcome = "converted"
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished the same conversion first; use its copy.
            outcome = "another process converted first"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "%s: %s -> %s (%.2f s)", outcome, gguf_path, target, time.perf_counter() - start
    )
    return target


def _stale_conversion(entry: Path) -> tuple[bool, str]:
    """Whether a finished entry can never be used again, and why: converted by an older
    layout, or its file changed since (then its key is another's). A file gone counts once
    the entry is an hour old: the path may be a mount another process sees and this one
    does not. Entries of a newer layout are another install's (a shared cache dir)."""
    recorded = json.loads((entry / SOURCE).read_text())
    if recorded["version"] < _CONVERSION_VERSION:
        return True, "an older layout"
    if recorded["version"] > _CONVERSION_VERSION:
        return False, ""
    path = Path(recorded["path"])
    if not path.is_file():
        return time.time() - entry.stat().st_mtime > _STALE_AGE_S, "its file is gone"
    return _source(path) != recorded, "its file changed"


def _remove_stale_entries(root: Path) -> None:
    """Remove what in the cache `root` nothing can use again (module docstring): a process
    killed mid-conversion leaves its temporary directory (hundreds of MB) behind; an entry's
    file may have gone or changed, or its layout version may be old."""
    for entry in root.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            continue  # not written here
        try:
            if entry.name.startswith(".") or not (entry / SOURCE).is_file():
                stale = time.time() - entry.stat().st_mtime > _STALE_AGE_S
                why = "left behind"
            else:
                stale, why = _stale_conversion(entry)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # removed by someone else meanwhile, or not ours to judge
        if stale:
            logger.info("removing the stale GGUF cache entry %s (%s)", entry, why)
            shutil.rmtree(entry, ignore_errors=True)


def _write_config_and_tokenizer(model: "GGUFModel", out_dir: Path) -> None:
    from v1.models.gguf_conversion import write_index  # torch loaded: `model` was read

    eos = None
    if model.has_tokenizer:
        # transformers builds the tokenizer (and chat template) from the GGUF metadata;
        # saving it turns that into plain tokenizer files, which load in well under a second.
        path = model.path
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer.save_pretrained(out_dir)
        eos = tokenizer.eos_token_id
    write_index(model, out_dir / TENSOR_INDEX, eos)
    model.config.save_pretrained(out_dir)
