"""Hugging Face Hub ids ("org/name"), found in the local Hugging Face cache (v1 never downloads).

The cache is huggingface_hub's, found at call time: $HF_HUB_CACHE, else $HF_HOME/hub, else
~/.cache/huggingface/hub. A cached model is `models--org--name/snapshots/<commit>/`, whose
files link into `blobs/`; `refs/<branch or tag>` holds the commit a revision names.
"""

import os
import re
from pathlib import Path

# What an id looks like here: "org/name" (the Hub's own checks, stricter, come after).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9_][\w.-]*")


def looks_like_repo_id(model: str) -> bool:
    return _REPO_ID.fullmatch(model) is not None


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps models, as it reads its environment variables (read now, not
    at import, so that a changed environment counts)."""
    # huggingface_hub's own variables, read as it reads them so that both find one cache:
    # not v1's, so not in v1.envs (which holds v1's settings).
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
        )
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def resolve_repo_id(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot directory of `repo_id` at `revision` (a branch, tag or commit; None: main)
    in the local cache. None when huggingface_hub says `repo_id` is no valid id; ValueError,
    saying where it looked and how to fetch it, when it is not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=True
        )
    except HFValidationError:
        return None
    except LocalEntryNotFoundError as e:  # not cached, or (a subclass) a partial download
        at = "" if revision is None else f" at revision {revision!r}"
        # The plain "not found" message tells to go online; a partial one's lists what is missing.
        detail = "" if type(e) is LocalEntryNotFoundError else f" ({e})"
        fetch = f"hf download {repo_id}" + ("" if revision is None else f" --revision {revision}")
        raise ValueError(
            f"model {repo_id!r} is not a local path, and the Hugging Face cache {str(cache)!r} "
            f"holds no complete snapshot of it{at}{detail}. v1 does not download: on a machine "
            f"with network, fetch it with `{fetch}` (older huggingface_hub: "
            f"`huggingface-cli download {repo_id}`), then bring that cache here or point "
            "HF_HUB_CACHE (or HF_HOME) at it"
        ) from None
    return Path(folder)


def repo_id_of_snapshot(path: Path) -> str | None:
    """"org/name" for a cache snapshot directory (`.../models--org--name/snapshots/<commit>`),
    else None: the name a model loaded by hub id goes by, as in vLLM."""
    repo = path.parent.parent.name
    if path.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/")
