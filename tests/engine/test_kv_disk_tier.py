"""The disk tier end to end, with the real default model: engines in this process sharing the
session's weights, each "restart" a new engine on the same kv_cache_dir."""

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from v1 import LLM, SamplingParams
from v1.request import RequestStatus
from v1.worker.kv_disk_store import DiskKVStore

SYSTEM = (
    "You are the help desk of a small public library. Opening hours are Monday to Friday "
    "from nine to eight, Saturday from ten to four, closed on Sunday. Loans last three weeks "
    "and can be renewed twice online. Late fees are twenty cents a day per item. Study rooms "
    "are booked online for up to two hours a day. Keep answers short and friendly. "
)  # about 100 tokens: 6 full blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
ENGINE = {"num_gpu_blocks": 64, "max_model_len": 512, "multiprocess": False}

pytestmark = pytest.mark.model


def engine(gguf_model, kv_dir: Path | None, **kwargs) -> LLM:
    options = {**ENGINE, **kwargs}
    if kv_dir is not None:
        options["kv_cache_dir"] = str(kv_dir)
    return LLM(loaded_model=gguf_model, **options)


def run(llm: LLM, prompt, params: SamplingParams = GREEDY):
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def full_prefix(llm: LLM, prompt: str) -> int:
    """The most tokens of `prompt` a prefix hit may cover: its full blocks, short of the
    last token."""
    return (len(llm.get_tokenizer().encode(prompt)) - 1) // 16 * 16


def block_files(kv_dir: Path) -> list[Path]:
    return sorted(kv_dir.glob("*/*.kv"))


def test_a_restarted_engine_reads_the_prefix_from_disk_same_tokens(gguf_model, tmp_path):
    question = SYSTEM + "When do you open on Saturday?"
    with engine(gguf_model, tmp_path) as first:
        cold_tokens, cold_cached = run(first, question)
    assert cold_cached == 0
    files = block_files(tmp_path)
    assert files, "the computed blocks were written"
    with engine(gguf_model, tmp_path) as second:  # a restart: nothing in RAM
        warm_tokens, warm_cached = run(second, question)
        stats = second.get_stats()
        expected = full_prefix(second, question)
    assert warm_tokens == cold_tokens
    assert warm_cached == expected > 0 and stats.disk_cache_hits == warm_cached
    assert stats.prefix_cache_hits == warm_cached


def test_async_scheduling_reads_a_new_question_on_a_cached_prefix(gguf_model, tmp_path):
    with engine(gguf_model, tmp_path) as first:
        run(first, SYSTEM + "How long can I keep a book?")
        reference, _ = run(first, SYSTEM + "Are you open on Sunday?")  # RAM hit in `first`
    with engine(gguf_model, tmp_path, async_scheduling=True) as second:
        tokens, cached = run(second, SYSTEM + "Are you open on Sunday?")
    assert tokens == reference and cached > 0


@pytest.mark.parametrize("change", [{"block_size": 32}, {"kv_cache_dtype": "bfloat16"}])
def test_another_kv_setting_never_reads_the_files(gguf_model, tmp_path, change):
    with engine(gguf_model, tmp_path) as first:
        run(first, SYSTEM + "Hello?")
    with engine(gguf_model, tmp_path, **change) as other:
        _, cached = run(other, SYSTEM + "Hello?")
        assert other.get_stats().disk_cache_hits == 0
    assert cached == 0
    assert len(list(tmp_path.iterdir())) == 2  # a directory per key


def test_truncated_and_corrupt_files_are_ignored(gguf_model, tmp_path):
    question = SYSTEM + "What is the late fee?"
    with engine(gguf_model, tmp_path) as first:
        reference, _ = run(first, question)
    files = block_files(tmp_path)
    assert len(files) >= 4
    with open(files[0], "r+b") as f:  # which block is which: by name, so any one
        f.truncate(1000)
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 0xFF
    files[1].write_bytes(data)
    with engine(gguf_model, tmp_path) as second:
        tokens, cached = run(second, question)
        assert cached < full_prefix(second, question)
    assert tokens == reference  # whatever was read before the bad file, the rest computed


def test_block_files_copied_onto_another_prompts_names_are_not_read(gguf_model, tmp_path):
    """A file carries the hash its name stands for under its checksum: copied or renamed onto
    another block's name it is a miss, never another prompt's K/V."""
    other = (
        "You answer questions about the city's bus network. Buses run every ten minutes on "
        "weekdays and every twenty at weekends; night buses leave the central station at "
        "midnight, one and two. A day ticket costs four euros and children travel free. "
        "Bicycles ride along outside rush hours, dogs on a lead at all times, and lost "
        "property waits a month at the depot on the harbour road before it is given away. "
    )
    with engine(gguf_model, tmp_path) as first:
        run(first, SYSTEM + "Hi?")
    first_files = block_files(tmp_path)  # written by the time it is closed
    with engine(gguf_model, tmp_path) as first:
        reference, _ = run(first, other + "Hi?")
    other_files = sorted(set(block_files(tmp_path)) - set(first_files))
    assert first_files and len(other_files) >= 4
    for i, target in enumerate(other_files):
        shutil.copyfile(first_files[i % len(first_files)], target)
    with engine(gguf_model, tmp_path) as second:
        tokens, cached = run(second, other + "Hi?")
    assert tokens == reference and cached == 0


def test_a_fifo_in_place_of_a_block_file_is_a_miss_and_blocks_nothing(gguf_model, tmp_path):
    """A block file replaced by a FIFO while the server runs: the read takes it as a miss
    (opened O_NONBLOCK, regular files only), the request is served. The join's timeout only
    keeps a failing run from hanging."""
    question = SYSTEM + "Can I renew a loan?"
    with engine(gguf_model, tmp_path) as first:
        reference, _ = run(first, question)
    with engine(gguf_model, tmp_path) as second:
        fifos = block_files(tmp_path)  # which is the first block: by name, so all of them
        for fifo in fifos:
            fifo.unlink()
            os.mkfifo(fifo)
        result = []
        worker = threading.Thread(target=lambda: result.append(run(second, question)),
                                  daemon=True)
        worker.start()
        worker.join(120)
        if worker.is_alive():  # blocked in open(): writers let it go, then fail
            for fifo in fifos:
                try:  # succeeds on the FIFO a reader waits on
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
            worker.join()
            pytest.fail("the step blocked on a FIFO")
    tokens, cached = result[0]
    assert tokens == reference and cached == 0
    # The one read was removed, its block computed and written again as a regular file.
    assert any(fifo.is_file() for fifo in fifos)


def test_a_read_longer_than_a_steps_bound_goes_on_over_steps(gguf_model, tmp_path):
    """A step reads at most `max_read_blocks` files: a longer read goes on in the next steps
    and its request runs once it is done, as a full hit, same tokens."""
    question = SYSTEM + "Where can I study?"
    with engine(gguf_model, tmp_path) as first:
        reference, _ = run(first, question)
    with engine(gguf_model, tmp_path) as second:
        store = second.llm_engine.client.engine_core.model_runner.kv_disk
        store.max_read_blocks = 1
        read_per_step: list[int] = []  # files read by each step's `load`
        load, read_blocks = store.load, store._read_blocks

        def counting_load(kv_caches, loads):
            read_per_step.append(0)
            return load(kv_caches, loads)

        def counting_read(kv_caches, block_ids, hashes):
            read_per_step[-1] += len(hashes)
            return read_blocks(kv_caches, block_ids, hashes)

        store.load, store._read_blocks = counting_load, counting_read
        tokens, cached = run(second, question)
        expected = full_prefix(second, question)
        assert second.get_stats().disk_cache_hits == cached
    assert tokens == reference and cached == expected
    assert max(read_per_step) == 1 and sum(read_per_step) == expected // 16


def test_the_byte_bound_holds(gguf_model, tmp_path):
    with engine(gguf_model, tmp_path) as probe:
        run(probe, SYSTEM)
    file_bytes = block_files(tmp_path)[0].stat().st_size
    bound = 3 * file_bytes + 100
    with engine(gguf_model, tmp_path / "bounded", kv_cache_disk_bytes=bound) as llm:
        run(llm, SYSTEM + "First?")
        run(llm, "Something else entirely, to write more blocks than the bound allows. " * 4)
    assert len(block_files(tmp_path / "bounded")) == 3


def test_cache_salt_isolates_on_disk(gguf_model, tmp_path):
    salted = {"prompt": SYSTEM + "Hi?", "cache_salt": "tenant-a"}
    with engine(gguf_model, tmp_path) as first:
        run(first, salted)
    with engine(gguf_model, tmp_path) as second:
        _, other_salt = run(second, {**salted, "cache_salt": "tenant-b"})
        _, same_salt = run(second, salted)
        assert second.get_stats().disk_cache_hits == same_salt
    assert other_salt == 0 and same_salt > 0


def test_reset_prefix_cache_keeps_the_disk_unless_asked(gguf_model, tmp_path):
    with engine(gguf_model, tmp_path) as llm:
        run(llm, SYSTEM + "Hi?")
        assert llm.reset_prefix_cache()
        _, cached = run(llm, SYSTEM + "Hi?")
        assert cached > 0 and llm.get_stats().disk_cache_hits == cached  # from disk
        assert llm.reset_prefix_cache(reset_connector=True)
        assert not block_files(tmp_path)
        _, cached = run(llm, SYSTEM + "Hi?")
    assert cached == 0


def test_a_reset_right_after_a_request_finds_its_blocks_on_disk(gguf_model, tmp_path,
                                                                monkeypatch):
    """Writes slower than the request's steps (a loaded machine's disk): the reset waits for
    them, so its blocks are found on disk after it."""
    real_write = DiskKVStore._write

    def slow_write(self, *args):
        time.sleep(0.05)
        return real_write(self, *args)

    monkeypatch.setattr(DiskKVStore, "_write", slow_write)
    with engine(gguf_model, tmp_path) as llm:
        run(llm, SYSTEM + "Hi?")
        assert llm.reset_prefix_cache()
        _, cached = run(llm, SYSTEM + "Hi?")
        assert cached == full_prefix(llm, SYSTEM + "Hi?") > 0
        assert llm.get_stats().disk_cache_hits == cached


def test_other_requests_keep_running_while_one_reads(gguf_model, tmp_path):
    with engine(gguf_model, tmp_path) as first:
        run(first, SYSTEM + "Hi?")
    with engine(gguf_model, tmp_path) as llm:
        engine_ = llm.llm_engine
        scheduler = engine_.client.engine_core.scheduler
        long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        engine_.add_request("busy", "The quick brown fox", long)
        engine_.step()
        busy = next(iter(scheduler.requests.values()))
        num_out = len(busy.output_token_ids)
        engine_.add_request("reader", SYSTEM + "Hi?", GREEDY)
        # The step that hands out the read still decodes the busy request.
        engine_.step()
        reader = next(r for r in scheduler.requests.values() if r is not busy)
        assert reader.status == RequestStatus.WAITING  # read, to be admitted next step
        assert reader.scheduled_time is None
        assert scheduler.kv_cache_manager.get_computed_blocks(reader)[1] > 0
        assert len(busy.output_token_ids) == num_out + 1
        while engine_.has_unfinished_requests():
            engine_.step()
        llm.llm_engine.client.engine_core.check_integrity()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"kv_cache_disk_bytes": -1}, r"kv_cache_disk_bytes must be an integer >= 1, got -1"),
        ({"kv_cache_disk_bytes": 1000}, r"kv_cache_disk_bytes \(1000\) is less than one KV "
                                        r"block on disk \(\d+ bytes\)"),
    ],
)
def test_bad_bounds_are_refused(gguf_model, tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        engine(gguf_model, tmp_path, **options)


def test_a_directory_that_cannot_be_written_fails_before_the_model_loads(
    default_model_path, tmp_path, monkeypatch
):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    monkeypatch.setattr("v1.engine.core.load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match=f"kv_cache_dir '{a_file}' cannot be created"):
        LLM(str(default_model_path), kv_cache_dir=str(a_file), multiprocess=False)
