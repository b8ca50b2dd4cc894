"""DeepSeek-V4.1's Engram tables on the device, in host memory or read in place from the checkpoint's files
(``engram_placement``, :mod:`deepinfer_core.models.deepseek_v41.engram_placement`).

What is proven here, on the CPU:

- the three placements give bit-identical logits on the tiny V4.1 (prefill, then decode steps);
- ``file`` keeps each table a view of the checkpoint file's mapping and ``host`` a copy in the process's
  memory, never the file: :func:`~deepinfer_core.model.mapped.residence` reads ``/proc/self/maps``, and the
  check is shown to fail on a copy;
- with ``file`` a table is never copied into anonymous memory: a fresh process loading a checkpoint whose
  Engram table holds ~420 MB grows its peak RSS (``VmHWM``) by a few MB where ``host`` and ``device`` grow it
  by the table and more, and its anonymous memory (``RssAnon``) stays flat through a step's lookups;
- the memory plan's default placement, and the refusal of an unknown one;
- ``file`` tables on an accelerator keep decode out of graphs (the device cannot address the mapping).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import engine_fixtures
import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core.entrypoints.llm import LLM
from deepinfer_core.model.mapped import residence
from deepinfer_core.models import load_model
from deepinfer_core.models.deepseek_v41.engram_placement import table_names
from deepinfer_core.parallel.memory_plan import engram_placement_for
from deepinfer_core.platform import Platform, SideStream
from deepinfer_core.testing.model_runner import SimpleRunner
from deepinfer_core.testing.tiny_v41 import build_tiny_v41, tiny_v41_config
from deepinfer_core.worker.worker import make_model_runner

IDS = torch.randint(5, 3900, (30,), generator=torch.Generator().manual_seed(3)).tolist()


one_torch_thread = engine_fixtures.one_torch_thread  # one intra-op thread: the tiny model's ops are faster


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_v41(tmp_path_factory.mktemp("v41") / "tiny", seed=2, with_drafter=False)


def logits(model) -> torch.Tensor:
    """Every position's logits: a prefill of 20 tokens, then one token a step."""
    runner = SimpleRunner(model, 1, 64, block_size=8)
    out = [runner.step({0: IDS[:20]}, all_logits=True)[0]]
    out += [runner.step({0: [t]}, all_logits=True)[0] for t in IDS[20:]]
    return torch.cat(out)


def tables(model) -> list[torch.Tensor]:
    return [t for block in model.weights.layers if block.engram is not None
            for t in (block.engram.table.weight, block.engram.table.scale)]


def test_the_three_placements_give_bit_identical_logits(tiny):
    runs = {p: logits(load_model(tiny, engram_placement=p)) for p in ("device", "host", "file")}
    assert torch.isfinite(runs["device"]).all()
    for placement in ("host", "file"):
        assert torch.equal(runs[placement], runs["device"]), placement
    # the Engram rows matter: a table of other rows changes the logits
    model = load_model(tiny, engram_placement="device")
    for block in model.weights.layers:
        if block.engram is not None:
            block.engram.table.weight.copy_(block.engram.table.weight.roll(1, 0))
    assert not torch.equal(logits(model), runs["device"])


class RecordingSideStream(SideStream):
    """Runs in program order, recording when each lookup starts and is joined."""

    def __init__(self, events: list):
        self.events = events

    def run(self, fn):
        self.events.append("run")
        return super().run(fn)

    def join(self, handle):
        self.events.append("join")
        return super().join(handle)


def test_each_engram_lookup_starts_with_the_step_and_is_joined_in_its_layer(tiny):
    """Both tables' rows are started before layer 0 (on the model runner's side stream on a device) and each
    is awaited only in its own Engram layer, so the reads overlap the layers before it; the logits are the
    same as looking each up in its layer."""
    model = load_model(tiny, engram_placement="host")
    inline = logits(model)
    events = []
    model.side_stream = RecordingSideStream(events)
    block = model.block

    def recording_block(w, layer, *args):
        events.append(layer)
        return block(w, layer, *args)

    model.block = recording_block
    assert torch.equal(logits(model), inline)
    layers = model.cfg.engram_layer_ids
    step = events[:events.index(model.cfg.num_hidden_layers - 1) + 1]
    expected = ["run"] * len(layers)
    for layer in range(model.cfg.num_hidden_layers):
        expected += ["join"] * (layer in layers) + [layer]
    assert step == expected, (step, layers)


def test_file_tables_are_views_of_the_checkpoint_and_host_tables_are_not(tiny):
    file = str((tiny / "model.safetensors").resolve())
    mapped = tables(load_model(tiny, engram_placement="file"))
    assert [residence(t) for t in mapped] == [file] * len(mapped)
    assert residence(mapped[0].clone()) == "anonymous"  # the check fails on a copy
    for placement in ("host", "device"):
        held = tables(load_model(tiny, engram_placement=placement))
        assert all(residence(t) == "anonymous" for t in held), placement
        assert all(not t.is_pinned() for t in held)  # pinned only for an accelerator's kernels


def test_an_unknown_placement_is_refused(tiny):
    with pytest.raises(ValueError, match="unknown engram_placement 'disk'"):
        load_model(tiny, engram_placement="disk")


def test_the_memory_plan_places_what_fits_where():
    gb = 10**9
    assert engram_placement_for(203 * gb, 2000 * gb, 141 * gb, 10 * gb)[0] == "host"
    assert engram_placement_for(203 * gb, 300 * gb, 141 * gb, 10 * gb)[0] == "file"
    assert engram_placement_for(2 * gb, 300 * gb, 141 * gb, 10 * gb)[0] == "device"
    assert engram_placement_for(2 * gb, 300 * gb, None)[0] == "device"  # a CPU: the host is the device
    assert engram_placement_for(203 * gb, 300 * gb, None)[0] == "file"


# --- peak RSS of a large table ------------------------------------------------------------------------

#: Engram bucket search start: 4 columns of ~3.2 M rows, 33 B a row: ~420 MB of table
LARGE_VOCAB = 3_200_000


def build_large_table_checkpoint(path: Path) -> int:
    """The tiny V4.1 with one Engram layer whose table holds ~420 MB, in a shard of its own; its byte size."""
    small = build_tiny_v41(path, seed=3, with_drafter=False, engram_layer_ids=[1])
    tensors = load_file(str(small / "model.safetensors"))
    config = tiny_v41_config(engram_layer_ids=[1], engram_vocab_size=LARGE_VOCAB)
    rows = config["text_config"]["engram_num_embeddings"][0]
    name = table_names(type("C", (), {"engram_layer_ids": [1]}))[0]
    del tensors[name], tensors[name.removesuffix(".weight") + ".scale"]
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 0x7F, (rows, 32), dtype=torch.uint8, generator=gen)  # no NaN byte (0x7F)
    table |= torch.randint(0, 2, (rows, 1), dtype=torch.uint8, generator=gen) << 7  # either sign
    scale = torch.full((rows, 1), 120, dtype=torch.uint8)  # 2^-7
    (path / "model.safetensors").unlink()
    save_file(tensors, str(path / "model-00001-of-00002.safetensors"))
    save_file({name: table.view(torch.float8_e4m3fn), name.removesuffix(".weight") + ".scale":
               scale.view(torch.float8_e8m0fnu)}, str(path / "model-00002-of-00002.safetensors"))
    del table
    weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors}
    weight_map.update({name: "model-00002-of-00002.safetensors",
                       name.removesuffix(".weight") + ".scale": "model-00002-of-00002.safetensors"})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return rows * 33


_MEASURE = """
import sys, torch
from pathlib import Path
from deepinfer_core.models import load_model
from deepinfer_core.testing.model_runner import SimpleRunner

def status(key):
    return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key)).split()[1])

torch.set_num_threads(1)
load_model(sys.argv[1], engram_placement="file")  # warm: imports, the tokenizer, the token map
before, anon_before = status("VmHWM:"), status("RssAnon:")
model = load_model(sys.argv[1], engram_placement=sys.argv[2])
loaded = status("VmHWM:")
SimpleRunner(model, 1, 64, block_size=8).step({0: list(range(5, 25))})  # rows looked up: the table is live
print(before * 1024, loaded * 1024, anon_before * 1024, status("RssAnon:") * 1024, status("RssFile:") * 1024)
"""


@pytest.mark.slow
def test_a_file_table_never_enters_anonymous_memory(tmp_path):
    size = build_large_table_checkpoint(tmp_path / "large")
    assert size > 400e6
    measured = {}
    for placement in ("file", "host", "device"):
        done = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "large"), placement],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        before, peak, anon_before, anon, mapped = map(int, done.stdout.split()[-5:])
        measured[placement] = {"load_peak_growth": peak - before, "anon_growth": anon - anon_before,
                               "file_rss": mapped}
    print(json.dumps({"table_bytes": size, **measured}))
    # file: loading grows the peak RSS by far less than the table, and neither loading nor a step's lookups
    # add anonymous memory of that order (the rows read are the page cache's, mapped: RssFile, shared)
    assert measured["file"]["load_peak_growth"] < 0.1 * size, measured
    assert measured["file"]["anon_growth"] < 0.1 * size, measured
    # the measure tells the difference: a host or device copy is the whole table in anonymous memory
    for placement in ("host", "device"):
        assert measured[placement]["load_peak_growth"] > 0.9 * size, (placement, measured)
        assert measured[placement]["anon_growth"] > 0.9 * size, (placement, measured)


def test_the_plan_shows_the_bytes_each_placement_puts_where():
    from deepinfer_core.parallel.memory_plan import engram_bytes

    gb = 10**9
    rows = {e.placement: e for e in engram_bytes(203 * gb, 8, 62 * gb, 141 * gb)}
    assert list(rows) == ["device", "device sharded", "host", "file"]
    assert (rows["device"].device_bytes_per_rank, rows["device"].host_bytes_per_node) == (203 * gb, 0)
    assert rows["device sharded"].device_bytes_per_rank == -(-203 * gb // 8)
    assert (rows["host"].device_bytes_per_rank, rows["host"].host_bytes_per_node) == (0, 203 * gb)
    assert (rows["file"].device_bytes_per_rank, rows["file"].host_bytes_per_node) == (0, 0)
    assert [e.fits for e in rows.values()] == [False, True, True, True]
    assert "device sharded" not in {e.placement for e in engram_bytes(203 * gb, 1, 62 * gb, None)}


class _GraphPlatform(Platform):
    """A platform that would capture graphs: make_model_runner must decide against them before asking."""

    supports_graphs = True


def test_file_tables_keep_an_accelerator_decode_eager(tiny, caplog):
    """A device cannot address a file's pageable mapping, so ``file`` tables are gathered on the host: the
    model reports that wait and the runner is built without graphs (the capture would fail); ``host`` and
    ``device`` tables, and any table on the CPU, wait for nothing."""
    for placement in ("device", "host", "file"):
        assert load_model(tiny, engram_placement=placement).host_waits() == []  # the CPU reads the mapping
    llm = LLM(str(tiny), backend="cpu_ref", dtype="float32", max_num_seqs=2, max_model_len=64,
              engram_placement="file")
    worker = llm.llm_engine._worker
    model = worker.model
    model.device = torch.device("meta")  # stands for an accelerator: only the type is read
    assert "file mapping" in model.host_waits()[0]
    with caplog.at_level(logging.WARNING):
        runner = make_model_runner(model, worker.cache, llm.llm_engine.sampler, worker.args,
                                   worker.scheduler_config, worker.backend, _GraphPlatform(torch.device("cpu")))
    assert runner.graph_runner is None
    assert "decode runs without graphs" in caplog.text and "file mapping" in caplog.text
    model.engram_placement = "host"
    assert model.host_waits() == []
