"""The disk tier's files: one file per full KV block, named by its chained block hash, in a
directory keyed by everything that changes K/V. The scheduler's index
(`v1.core.kv_disk_index`) decides what to read, write and delete; this does the I/O.

Layout: `kv_cache_dir/<xxh3-128 of cache_key_facts>/<32 hex digits of the hash>.kv`
(`meta.json` holds the facts, for people):

    header (56 bytes): magic b"v1kvblk2", payload length (u64), the block's hash (16 bytes:
            its tokens, cache_salt and adapter), the directory's key (16 bytes: the model and
            KV setting), xxh3-64 of the header's first 48 bytes and the payload (u64)
    payload: the block's K and V of every layer, [layers, 2, block_size, kv_heads, head_size]
             in the KV cache dtype, raw

Contract: the directories are 0700 and the files 0600, the server user's (`open_kv_cache_dir`
refuses a root others can reach); files appear by rename of a temporary created with
O_EXCL|O_NOFOLLOW under an unpredictable name (complete or absent); a file is read only if it
is a regular file (opened O_NONBLOCK|O_NOFOLLOW: a FIFO or a link is a miss) whose header names
the block and directory it is read for (a file copied onto another block's name is a miss);
a bad file is never used and is removed; `save` copies after the forward and queues for the
writer thread (dropped, reported unwritten, over `max_queue_bytes`); `load` reads on the step's
thread before its forward, at most `max_read_bytes` of files per step (a read goes on in the
next steps, reported when done). The rest of the contract and why: docs/prefix-cache.md, "The
prefix cache on disk", and docs/serving.md, "Disk tier files".
"""

import json
import logging
import os
import queue
import secrets
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from v1.core.sched.output import KVLoad

logger = logging.getLogger("v1")

MAGIC = b"v1kvblk2"
_IDENTITY = struct.Struct("<8sQ16s16s")  # magic, payload length, block hash, directory key
_HEADER = struct.Struct(f"<{_IDENTITY.size}sQ")  # the identity, then the checksum
HEADER_BYTES = _HEADER.size
SUFFIX = ".kv"
STALE_TMP_S = 600.0
_MAX_BATCH_BYTES = 32 << 20
_DIGEST_SPAN = 1 << 20  # bytes of each weight file's head and tail in the fingerprint


def weights_fingerprint(model_path: Path) -> str:
    """Size plus the xxh3-128 of the first and last MiB of the weight file (a .gguf) or of
    every *.safetensors and config.json of an HF directory: a changed checkpoint changes it,
    without reading gigabytes at start-up."""
    files = (
        [model_path] if model_path.is_file()
        else sorted([*model_path.glob("*.safetensors"), model_path / "config.json"])
    )
    h = xxhash.xxh3_128()
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}:{size}:".encode())
        with open(file, "rb") as f:
            h.update(f.read(_DIGEST_SPAN))
            if size > _DIGEST_SPAN:
                f.seek(max(_DIGEST_SPAN, size - _DIGEST_SPAN))
                h.update(f.read(_DIGEST_SPAN))
    return h.hexdigest()


def cache_key_facts(
    model_path: Path,
    hf_config: Any,
    head_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    quantization: str | None,
    block_size: int,
) -> dict[str, Any]:
    """Everything that makes a block's K/V differ, besides its tokens (in its hash)."""
    return {
        "weights": weights_fingerprint(model_path),
        "architectures": list(getattr(hf_config, "architectures", None) or []),
        "num_layers": int(hf_config.num_hidden_layers),
        "num_kv_heads": int(hf_config.num_key_value_heads),
        "head_size": head_size,
        "rope_theta": getattr(hf_config, "rope_theta", None),
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": str(kv_cache_dtype).removeprefix("torch."),
        "quantization": quantization,
        "block_size": block_size,
        "format": MAGIC.decode(),
    }


def open_kv_cache_dir(path: str) -> Path:
    """The disk tier's root directory `path` (kv_cache_dir), created 0700 if need be.
    ValueError naming it when it cannot be created or written, or when it is not a
    directory of mode 0700 owned by this process's user: its files are every tenant's
    prompts' K/V, and a directory others may write lets them plant links and files. The
    engine calls this before the model loads."""
    root = Path(path).expanduser()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        _private_dir(root)
        st = root.stat()
    except OSError as e:
        raise ValueError(f"kv_cache_dir {path!r} cannot be created: {e}") from e
    uid, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if st.st_uid != uid or mode != 0o700:
        raise ValueError(
            f"kv_cache_dir {path!r} has mode {mode:04o} and owner uid {st.st_uid}; it must "
            f"be mode 0700 and owned by the server's user (uid {uid}), or other users could "
            "read every prompt's K/V and plant files there (chmod 700 it, or name another)"
        )
    if not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"kv_cache_dir {path!r} is not a writable directory")
    return root


def _private_dir(path: Path) -> None:
    """Create directory `path` with mode 0700 whatever the umask; an existing directory is
    left as it is (the caller checks it)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not path.is_dir():
            raise
        return
    os.chmod(path, 0o700)


def _create_private(directory: Path, name: str) -> tuple[int, Path]:
    """A new file for writing in `directory`, mode 0600, under `name` plus a random part:
    O_EXCL|O_NOFOLLOW, so that nothing planted there (a link to another file, a file of
    another user) is ever written through. Returns its descriptor and path."""
    tmp = directory / f".{name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(tmp, flags, 0o600), tmp


class DiskKVStore:
    """The block files of one cache key. `load`, `save`, `delete`, `take_stored` and
    `clear` are called from the step's thread; the writer thread does the writes and
    deletes in the order they were queued."""

    def __init__(
        self,
        root: Path,
        facts: dict[str, Any],
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        max_queue_bytes: int = 256 << 20,
        max_read_bytes: int = _MAX_BATCH_BYTES,
    ) -> None:
        """`block_shape`: one block's payload, [layers, 2, block_size, kv_heads, head_size];
        `max_read_bytes`: the most file bytes `load` reads per call (one block at least)."""
        key = xxhash.xxh3_128_digest(repr(sorted(facts.items())).encode())
        self.key = key
        self.directory = root / key.hex()
        _private_dir(self.directory)
        meta = self.directory / "meta.json"
        if not meta.exists():
            fd, tmp = _create_private(self.directory, meta.name)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(facts, indent=1))
            os.replace(tmp, meta)
        self.block_shape = block_shape
        self.dtype = dtype
        self.payload_bytes = int(np.prod(block_shape)) * dtype.itemsize
        self.file_bytes = HEADER_BYTES + self.payload_bytes
        self.max_queue_bytes = max_queue_bytes
        self.max_read_blocks = max(1, max_read_bytes // self.file_bytes)
        self._reads: deque[_Read] = deque()  # begun, not finished, oldest first
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._stored: list[tuple[bytes, bool]] = []
        self._queue: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="v1-kv-disk", daemon=True)
        self._writer.start()

    def path(self, block_hash: bytes) -> Path:
        return self.directory / (block_hash.hex() + SUFFIX)

    # -- start-up ---------------------------------------------------------------------

    def scan(self) -> list[bytes]:
        """The hashes of the complete-looking files here, least recently used (oldest
        mtime) first; a crashed writer's old temporary files are removed."""
        found: list[tuple[int, bytes]] = []
        now = time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                name = entry.name
                try:
                    st = entry.stat(follow_symlinks=False)  # links are not block files
                    if name.endswith(".tmp"):
                        if now - st.st_mtime > STALE_TMP_S:
                            os.unlink(entry.path)
                        continue
                    if not name.endswith(SUFFIX) or len(name) != 32 + len(SUFFIX):
                        continue
                    if stat.S_ISREG(st.st_mode) and st.st_size == self.file_bytes:
                        found.append((st.st_mtime_ns, bytes.fromhex(name[:32])))
                except (OSError, ValueError):  # vanished meanwhile, or not ours
                    continue
        found.sort()
        return [h for _, h in found]

    # -- batches: [layers, 2, n, block_size, kv_heads, head_size], one gather per layer ----

    def _batch(self, n: int) -> tuple[torch.Tensor, np.ndarray]:
        """A batch of n blocks, layer-major as the cache is (so that a layer's blocks move in
        one `index_select` / `index_copy_`: ~20x faster than per-block copies here), and
        its bytes as [layers * 2, n, chunk]: block i's file is rows [:, i] in order."""
        layers, _, *rest = self.block_shape
        batch = torch.empty((layers, 2, n, *rest), dtype=self.dtype)
        raw = batch.view(torch.uint8).numpy().reshape(layers * 2, n, -1)
        return batch, raw

    # -- reads (the step's thread, before the forward) -----------------------------------

    def load(self, kv_caches: list[torch.Tensor], loads: Sequence[KVLoad]) -> dict[str, int]:
        """Begin the step's `loads` and go on with those begun before, oldest first, reading
        at most `max_read_blocks` files in all; returns, for each load finished now, how many
        of its blocks were read, in a row from the first (a missing, short, corrupt or
        foreign file, or one that is not a regular file, ends it there and is removed). A
        load's blocks are its request's alone until it is reported, so it may take steps."""
        self._reads.extend(_Read(load) for load in loads)
        finished: dict[str, int] = {}
        budget = self.max_read_blocks
        while self._reads and budget:
            read = self._reads[0]
            load = read.load
            todo = min(budget, len(load.block_hashes) - read.num_read)
            start = read.num_read
            got = self._read_blocks(
                kv_caches, load.block_ids[start : start + todo],
                load.block_hashes[start : start + todo],
            )
            read.num_read += got
            budget -= todo
            if got < todo or read.num_read == len(load.block_hashes):
                finished[load.req_id] = read.num_read
                self._reads.popleft()
        return finished

    def _read_blocks(
        self, kv_caches: list[torch.Tensor], block_ids: Sequence[int], hashes: Sequence[bytes]
    ) -> int:
        """Read the blocks' files into those cache blocks; how many were read, in a row
        from the first."""
        batch, raw = self._batch(len(hashes))
        num_read = 0
        for i, block_hash in enumerate(hashes):
            path = self.path(block_hash)
            try:
                # O_NONBLOCK: opening a FIFO does not wait for a writer.
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:  # gone (another process evicted it)
                break
            except OSError:  # a link (O_NOFOLLOW), or not ours to read
                fd = -1
            ok = fd >= 0
            try:
                if ok:
                    st = os.fstat(fd)
                    ok = stat.S_ISREG(st.st_mode) and st.st_size == self.file_bytes
                if ok:
                    chunks = list(raw[:, i])
                    header = os.pread(fd, HEADER_BYTES, 0)
                    identity, digest = _HEADER.unpack(header)
                    ok = (
                        identity == self._identity(block_hash)
                        and os.preadv(fd, chunks, HEADER_BYTES) == self.payload_bytes
                        and _digest(identity, chunks) == digest
                    )
                if ok:
                    os.utime(fd)  # most recently used, for the LRU order after a restart
            except (OSError, struct.error):
                ok = False
            finally:
                if fd >= 0:
                    os.close(fd)
            if not ok:
                logger.warning("disk KV block %s is corrupt or not this block's: removed",
                               path.name)
                _unlink(path)
                break
            num_read += 1
        if num_read:
            for layer, kv in enumerate(kv_caches):
                ids = torch.tensor(block_ids[:num_read], dtype=torch.int64, device=kv.device)
                kv.index_copy_(1, ids, batch[layer, :, :num_read].to(kv.device))
        return num_read

    def _identity(self, block_hash: bytes) -> bytes:
        """What a file's header must say to be read as `block_hash`'s here."""
        return _IDENTITY.pack(MAGIC, self.payload_bytes, block_hash, self.key)

    # -- writes (queued; the writer thread does them) ------------------------------------

    def save(self, kv_caches: list[torch.Tensor], stores: Sequence[tuple[int, bytes]]) -> None:
        """Copy the blocks now (they hold this step's K/V; a later step may reuse them) and
        queue their files; over `max_queue_bytes`, they are reported unwritten instead."""
        size = len(stores) * self.payload_bytes
        with self._lock:
            if self._queued_bytes + size > self.max_queue_bytes:
                self._stored.extend((h, False) for _, h in stores)
                return
            self._queued_bytes += size
        # Batches under malloc's mmap threshold (64 MiB, see `tune_cpu_malloc`): reused heap
        # memory, not fresh pages faulted in on every large prefill.
        per_batch = max(1, _MAX_BATCH_BYTES // self.payload_bytes)
        for start in range(0, len(stores), per_batch):
            part = stores[start : start + per_batch]
            batch, raw = self._batch(len(part))
            for layer, kv in enumerate(kv_caches):
                ids = torch.tensor([b for b, _ in part], dtype=torch.int64, device=kv.device)
                if kv.device == batch.device:
                    torch.index_select(kv, 1, ids, out=batch[layer])
                else:
                    batch[layer].copy_(kv.index_select(1, ids))
            self._queue.put(("store", [h for _, h in part], raw))

    def delete(self, hashes: Sequence[bytes]) -> None:
        self._queue.put(("delete", hashes, None))

    def take_stored(self) -> list[tuple[bytes, bool]]:
        """(hash, written) of the writes finished since the last call."""
        with self._lock:
            stored, self._stored = self._stored, []
        return stored

    def flush(self) -> None:
        """Wait until every queued write and delete is done."""
        done = threading.Event()
        self._queue.put(("flush", done, None))
        done.wait()

    def clear(self) -> None:
        """Remove every block file of this key (after the queued work), and forget the
        writes not reported yet."""
        self.flush()
        for block_hash in self.scan():
            _unlink(self.path(block_hash))
        self.take_stored()

    def close(self) -> None:
        """Finish the queued work and stop the writer thread."""
        self.flush()
        self._queue.put(("stop", None, None))
        self._writer.join()

    def _write_loop(self) -> None:
        """The writer thread. It outlives any one item's failure: a dead writer would leave
        `flush` (a reset, shutdown) waiting forever and every later write unreported."""
        while True:
            kind, arg, data = self._queue.get()
            if kind == "store":
                results = [False] * len(arg)
                try:
                    for i, block_hash in enumerate(arg):
                        results[i] = self._write(block_hash, list(data[:, i]))
                except Exception:  # not a disk's failure (those _write reports): a bug
                    logger.exception("disk KV writer: a write failed; its blocks stay in RAM")
                with self._lock:
                    self._queued_bytes -= len(arg) * self.payload_bytes
                    self._stored.extend(zip(arg, results))
            elif kind == "delete":
                for block_hash in arg:
                    _unlink(self.path(block_hash))
            elif kind == "flush":
                arg.set()
            else:
                return

    def _write(self, block_hash: bytes, chunks: list[np.ndarray]) -> bool:
        path = self.path(block_hash)
        tmp = None
        try:
            fd, tmp = _create_private(self.directory, path.name)
            try:
                identity = self._identity(block_hash)
                header = _HEADER.pack(identity, _digest(identity, chunks))
                if os.writev(fd, [header, *chunks]) != self.file_bytes:
                    raise OSError("short write")
            finally:
                os.close(fd)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:  # a full disk, a removed directory: this block stays in RAM only
            logger.warning("could not write disk KV block %s: %s", path.name, e)
            return False
        finally:
            if tmp is not None:  # whatever failed
                _unlink(tmp)
        return True


@dataclass(slots=True)
class _Read:
    load: KVLoad
    num_read: int = 0  # its blocks read so far


def _digest(identity: bytes, chunks: list[np.ndarray]) -> int:
    """xxh3-64 of a file's identity and payload (given as its chunks in file order)."""
    h = xxhash.xxh3_64(identity)
    for chunk in chunks:
        h.update(chunk)
    return h.intdigest()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
