"""The matmul calibration (v1.models.calibration): the choice its timings give, its cache
(hit, miss, corrupt, what the key holds), the settings that switch it off, and the step
planner applying it. Every timing here is made up: nothing depends on this machine's speed."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.worker.test_fused_decode import gguf_model, prefilled  # noqa: F401
from tests.worker.test_model import Chunk, new_kv_caches
from tests.worker.test_model_runner import make_runner
from tests.worker.test_step_plan import DECODE, LAYERS, Calls, run
from v1 import envs
from v1.kernels import block_matmul, library, variants
from v1.models import calibration
from v1.models.calibration import Timings
from v1.models.layers.quantized import MatmulPolicy, QuantizedWeight
from v1.models.step_plan import PlanOptions, StepPath, StepPlanner

WEIGHTS = [(QuantizedWeight.quantize(torch.ones(64, 32), "q8_0"), 3)]


def timings(*ratios: float) -> Timings:
    """Made-up figures at 128/256/512 rows with dense taking `ratios` of int8's time."""
    return Timings((128, 256, 512), (10.0, 20.0, 40.0),
                   tuple(r * m for r, m in zip(ratios, (10.0, 20.0, 40.0))), ratios, 5.0)


class Timer:
    """A stand-in for `calibration.measure`: these timings (or by kind, `per_kind`'s), and
    how often it was asked."""

    def __init__(self, result: Timings, per_kind: dict[str, Timings] | None = None) -> None:
        self.result, self.per_kind = result, per_kind or {}
        self.weights: list[list[tuple[str, int, int, int]]] = []

    def __call__(self, q, weights) -> Timings:
        self.weights.append(sorted((w.kind, w.out_features, w.in_features, n)
                                   for w, n in weights))
        return self.per_kind.get(weights[0][0].kind, self.result)

    @property
    def calls(self) -> int:
        return len(self.weights)


@pytest.fixture(autouse=True)
def _new_process(monkeypatch):
    """Each test as a process of its own: nothing remembered from another."""
    monkeypatch.setattr(calibration, "_chosen", {})


def choose(cache: Path, timer: Timer, library_id: str = "_v1_x.so:abc",
           weights=WEIGHTS) -> calibration.DenseMinRows:
    return calibration.prompt_dense_min_rows(None, library_id, weights, cache, timer)


def dense_from(rows: int) -> calibration.DenseMinRows:
    """The choice for WEIGHTS' one kind: dense from `rows`."""
    return (("q8_0", rows),)


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "matmul calibration" in r.getMessage()]


@pytest.mark.parametrize("ratios, chosen", [
    ((1.5, 0.7, 0.7), 256),  # dense clearly faster from 256 rows on
    ((0.8, 0.8, 0.8), 128),
    ((0.9, 0.9, 0.9), 128),  # exactly the margin counts
    ((0.8, 0.95, 0.85), 512),  # only from the count where every larger one agrees
    ((0.7, 0.7, 0.95), None),  # the largest misses: int8 everywhere
    ((1.2, 1.1, 1.0), None),
    ((0.95, 0.92, 0.91), None),  # faster, but not by the margin
])
def test_the_choice(ratios, chosen):
    assert timings(*ratios).choice() == chosen


def test_measured_once_then_read_from_the_cache(tmp_path, caplog, monkeypatch):
    timer = Timer(timings(1.5, 0.7, 0.7))
    with caplog.at_level(logging.INFO, logger="v1"):
        assert choose(tmp_path, timer) == dense_from(256)
        assert timer.calls == 1
        (path,) = tmp_path.iterdir()
        data = json.loads(path.read_text())
        figures = data["kinds"]["q8_0"]
        assert figures["prompt_dense_min_rows"] == 256
        assert figures["dense_vs_int8"] == [1.5, 0.7, 0.7]
        assert data["key"]["library"] == "_v1_x.so:abc"
        # The same process: remembered, not read nor logged again.
        assert choose(tmp_path, timer) == dense_from(256) and timer.calls == 1
        monkeypatch.setattr(calibration, "_chosen", {})  # the next start
        assert choose(tmp_path, timer) == dense_from(256) and timer.calls == 1
    first, second = messages(caplog)
    assert "(_v1_x.so:abc" in first and ", measured)" in first and "from cache" in second
    for m in (first, second):
        assert "q8_0 rows 128/256/512: int8 10.0/20.0/40.0 ms, dense 15.0/14.0/28.0 ms" in m
        assert "dense/int8 1.50/0.70/0.70 (measured in 5 ms)" in m
        assert m.endswith("prompt chunks of 256+ rows take dense, smaller ones int8")
    monkeypatch.setattr(calibration, "_chosen", {})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="v1"):
        assert choose(tmp_path / "other", Timer(timings(1.2, 1.1, 1.0))) == ()
    assert messages(caplog)[0].endswith("prompt chunks take int8 at every size")


def test_each_kind_timed_and_chosen_apart(tmp_path, caplog):
    """A kind whose int8 tile is slow at many rows takes dense where the others keep int8."""
    weights = [*WEIGHTS, (QuantizedWeight.quantize(torch.ones(64, 64), "q4_1"), 2)]
    timer = Timer(timings(1.5, 1.2, 1.1), {"q4_1": timings(0.95, 0.8, 0.5)})
    with caplog.at_level(logging.INFO, logger="v1"):
        assert choose(tmp_path, timer, weights=weights) == (("q4_1", 256),)
    assert timer.weights == [[("q4_1", 64, 64, 2)], [("q8_0", 64, 32, 3)]]
    found = messages(caplog)
    assert len(found) == 2 and "q4_1 rows" in found[0] and "q8_0 rows" in found[1]
    assert found[0].endswith("of 256+ rows take dense, smaller ones int8")
    assert found[1].endswith("take int8 at every size")
    (path,) = tmp_path.iterdir()
    data = json.loads(path.read_text())
    del data["kinds"]["q4_1"]  # a file of other kinds than the model's: measured again
    path.write_text(json.dumps(data))
    calibration._chosen.clear()
    assert choose(tmp_path, timer, weights=weights) == (("q4_1", 256),) and timer.calls == 4


@pytest.mark.parametrize("content", [
    b"\xff\xfe not text", b"{", b"[]", b'"a string"', b"{}",
    b'{"key": {"cpu": "other"}, "rows": [128], "int8_ms": [1], "dense_ms": [1], '
    b'"dense_vs_int8": [0.5], "took_ms": 1}',
])
def test_a_corrupt_cache_file_is_measured_again(tmp_path, caplog, monkeypatch, content):
    timer = Timer(timings(1.5, 0.7, 0.7))
    choose(tmp_path, timer)
    (path,) = tmp_path.iterdir()
    path.write_bytes(content)
    monkeypatch.setattr(calibration, "_chosen", {})
    with caplog.at_level(logging.INFO, logger="v1"):
        assert choose(tmp_path, timer) == dense_from(256)
    assert timer.calls == 2
    assert any(f"{path} is corrupt" in m for m in messages(caplog))
    written = json.loads(path.read_text())["kinds"]["q8_0"]  # written again
    assert written["prompt_dense_min_rows"] == 256


def test_figures_of_unequal_lengths_or_not_numbers_are_corrupt(tmp_path, monkeypatch):
    timer = Timer(timings(1.5, 0.7, 0.7))
    choose(tmp_path, timer)
    (path,) = tmp_path.iterdir()
    data = json.loads(path.read_text())
    data["kinds"]["q8_0"]["dense_vs_int8"] = [0.5]
    path.write_text(json.dumps(data))
    monkeypatch.setattr(calibration, "_chosen", {})
    assert choose(tmp_path, timer) == dense_from(256) and timer.calls == 2
    # NaN > MARGIN is false: would pass
    data["kinds"]["q8_0"]["dense_vs_int8"] = [float("nan"), 0.5, 0.5]
    path.write_text(json.dumps(data))
    monkeypatch.setattr(calibration, "_chosen", {})
    assert choose(tmp_path, timer) == dense_from(256) and timer.calls == 3


def test_an_unreadable_unwritable_cache_is_no_error(tmp_path, caplog):
    timer = Timer(timings(0.7, 0.7, 0.7))
    choose(tmp_path, timer)
    (path,) = tmp_path.iterdir()
    path.unlink()
    path.mkdir()  # neither read nor replaced
    calibration._chosen.clear()
    with caplog.at_level(logging.WARNING, logger="v1"):
        assert choose(tmp_path, timer) == dense_from(128)
    assert timer.calls == 2
    found = messages(caplog)
    assert any("cannot read" in m for m in found) and any("cannot write" in m for m in found)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_the_key_changes_with_the_library_and_names_the_machine(tmp_path):
    timer = Timer(timings(1.5, 0.7, 0.7))
    choose(tmp_path, timer, "_v1_x.so:abc")
    choose(tmp_path, timer, "_v1_x.so:abd")  # the same variant, rebuilt from other sources
    choose(tmp_path, timer, "_v1_y.so:abc")
    assert timer.calls == 3 and len(list(tmp_path.iterdir())) == 3
    key = calibration.machine_key("_v1_x.so:abc", WEIGHTS, 3)
    assert key["cpu"] == library.cpu_model()
    assert set(key["cpu_flags"].split()) <= variants.cpu_flags()
    assert key["torch"].startswith(torch.__version__)
    assert key["threads"] == "3" and key["weights"] == "q8_0:64x32*3"
    assert calibration.machine_key("_v1_x.so:abc", WEIGHTS, 2) != key


@pytest.mark.skipif(library.library() is None, reason="no C kernels")
def test_the_library_is_named_by_variant_and_sources():
    lib = library.library()
    name, digest = calibration.library_id(lib).split(":")
    assert name.startswith("_v1_") and name.endswith(".so")
    assert digest == variants.sources_hash(library.CSRC_DIR)


def calibration_dir(**environ: str) -> Path | None:
    return PlanOptions.from_env(envs.read({"V1_CACHE_DIR": "/c", **environ})).calibration_dir


def test_the_settings_that_switch_it_off():
    assert calibration_dir() == Path("/c/calibration")
    assert calibration_dir(V1_MATMUL_CALIBRATION="1") == Path("/c/calibration")
    assert calibration_dir(V1_QUANT_ALL_INT8="") == Path("/c/calibration")  # empty: unset
    assert calibration_dir(V1_MATMUL_CALIBRATION="0") is None
    # The matmul paths set explicitly win, whatever the calibration would say.
    assert calibration_dir(V1_QUANT_ALL_INT8="1") is None
    assert calibration_dir(V1_QUANT_ALL_INT8="0") is None
    assert calibration_dir(V1_QUANT_INT8_MIN_ROWS="8") is None
    with pytest.raises(ValueError, match="V1_MATMUL_CALIBRATION"):
        envs.read({"V1_MATMUL_CALIBRATION": "maybe"})


@pytest.mark.model
def test_the_planner_applies_it_to_prompt_chunks(gguf_model, tmp_path,  # noqa: F811
                                                 monkeypatch):
    timer = Timer(timings(1.5, 0.7, 0.7))
    monkeypatch.setattr(calibration, "measure", timer)
    options = PlanOptions(calibration_dir=tmp_path)
    planner = StepPlanner(gguf_model, torch.float32, torch.device("cpu"), options)
    # The layers' shapes, each once (not the tied LM head's), in the layout they were loaded
    # in for this library.
    kind = block_matmul.kernels().types["q4_1"].repack or "q4_1"
    assert planner.options == PlanOptions(
        matmul=MatmulPolicy(prompt_dense_min_rows=((kind, 256),)), calibration_dir=tmp_path)
    assert timer.weights == [[(kind, 576, 576, LAYERS), (kind, 576, 1536, LAYERS),
                              (kind, 960, 576, LAYERS), (kind, 3072, 576, LAYERS)]]
    calls = Calls(monkeypatch)
    dequantized = []
    dequantize = block_matmul.QuantKernels.dequantize
    monkeypatch.setattr(block_matmul.QuantKernels, "dequantize",
                        lambda this, w: dequantized.append(w) or dequantize(this, w))
    chunk = [Chunk(list(range(300)), 0, list(range(19)))]
    prompt = np.ones(300, dtype=bool)
    assert run(gguf_model, new_kv_caches(gguf_model, 40), chunk, options, prompt) == StepPath(
        "per-op", "sdpa", "dense", "native")
    assert not calls.matmul and len(dequantized) == 4 * LAYERS
    prompt[-2:] = False  # two generated tokens' rows beside: int8
    assert run(gguf_model, new_kv_caches(gguf_model, 40), chunk, options, prompt) == StepPath(
        "per-op", "sdpa", "dense+int8", "native")
    assert calls.matmul == [True] * 4 * LAYERS
    # A smaller chunk: int8, as without the calibration (fused or not, by its attention).
    dequantized.clear()
    small = [Chunk(list(range(200)), 0, list(range(13)))]
    assert run(gguf_model, new_kv_caches(gguf_model, 40), small, options,
               np.ones(200, dtype=bool)).matmul == "int8"
    assert not dequantized
    assert run(gguf_model, prefilled(gguf_model, [list(range(100, 120))]), DECODE, options,
               np.zeros(1, dtype=bool)) == StepPath("fused", "kernel", "int8", "native")
    assert timer.calls == 1  # once per process, however many planners
    # No C kernels: nothing to calibrate.
    monkeypatch.setattr(calibration, "_chosen", {})
    off = StepPlanner(gguf_model, torch.float32, torch.device("cpu"),
                      PlanOptions(cpu_kernels="0", calibration_dir=tmp_path))
    assert off.options.matmul == MatmulPolicy() and timer.calls == 1


@pytest.mark.model
def test_the_runner_calibrates_only_block_weights(default_model, tmp_path, monkeypatch):
    """V1_MATMUL_CALIBRATION's default reaches the runner; fp32 weights time nothing."""
    timer = Timer(timings(0.7, 0.7, 0.7))
    monkeypatch.setattr(calibration, "measure", timer)
    monkeypatch.setenv("V1_MATMUL_CALIBRATION", "1")
    monkeypatch.setenv("V1_CACHE_DIR", str(tmp_path))
    runner = make_runner(default_model)
    assert runner.planner.options.calibration_dir == tmp_path / "calibration"
    assert runner.planner.options.matmul == MatmulPolicy() and timer.calls == 0


class ClockedWeight:
    """A weight whose paths take `ms_per_row[path](rows)` ms on a made-up clock."""

    in_features = 8

    def __init__(self, clock: list[float], ms_per_row: dict) -> None:
        self.clock, self.ms_per_row = clock, ms_per_row
        self.calls: list[tuple[str, int]] = []

    def linear(self, x, bias, path, q) -> None:
        self.calls.append((path, x.shape[0]))
        self.clock[0] += self.ms_per_row[path](x.shape[0]) / 1e3


@pytest.mark.parametrize("dense_ms, measured, chosen, rounds", [
    (lambda m: 2.0 if m < 256 else 0.5, (128, 256, 512), 256, (1, 1, 1)),
    # the largest misses, but not clearly: three rounds there, no smaller count timed
    (lambda m: 0.5 if m < 512 else 0.95, (512,), None, (3,)),
    (lambda m: 2.0 if m < 512 else 0.8, (256, 512), 512, (1, 3)),
])
def test_measured_from_the_largest_count_down_until_dense_misses(monkeypatch, dense_ms,
                                                                  measured, chosen, rounds):
    clock = [0.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    weight = ClockedWeight(clock, {"int8": lambda m: m * 1.0, "dense": lambda m: m * dense_ms(m)})
    result = calibration.measure(None, [(weight, 2)])
    assert result.rows == measured and result.choice() == chosen
    assert result.int8_ms == pytest.approx(tuple(2.0 * m for m in measured))
    # a dense warm-up call at the largest count, then each count's paired rounds
    timed = [("dense", 512)] + [
        (path, m) for m, n in sorted(zip(measured, rounds), reverse=True)
        for r in range(n) for path in (("int8", "dense") if r % 2 == 0 else ("dense", "int8"))]
    assert weight.calls == timed


def test_the_key_names_the_isa_onednn_is_held_to(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    default = calibration.machine_key("_v1_x.so:abc", WEIGHTS, 2)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    held = calibration.machine_key("_v1_x.so:abc", WEIGHTS, 2)
    assert (default["onednn_max_isa"], held["onednn_max_isa"]) == ("ALL", "AVX2")
