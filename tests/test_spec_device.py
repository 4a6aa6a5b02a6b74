"""The spec stage on a device: it computes where it is told and records it, refuses before
loading anything when memory is short, picks presets by model size, trains the GPU's
dtype layout (bf16 frozen base, fp32 module) through the same code on the CPU, runs data-parallel
under torchrun with identical weights on every rank, and (`gpu`) runs end to end on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdeploy import checkpoints, resolve
from specdeploy.device import describe, resolve_device
from specdeploy.errors import SpecDeployError
from specdeploy.manifest import BuildDir
from specdeploy.runtime.types import acceptance_length
from specdeploy.speculator import commands, load_spec_model, module_state_dict, presets
from specdeploy.speculator import train as train_mod
from specdeploy.speculator.distill import distill
from specdeploy.speculator.parallel import Parallel, setup
from specdeploy.speculator.train import TrainSettings, data_layers, export_draft, fit, train
from specdeploy.speculator.validate import CategoryResult, overall
from specdeploy.triton.serve import free_ports

TINY = dict(num_prompts=8, teacher_forced=0, max_new_tokens=16, window=32, batch_size=4, draft_vocab=96, distill_batch=8)
ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("spec_cache")  # conftest: a private data cache, one thread


@pytest.fixture(scope="module")
def data(tiny_llama_dir):
    return distill(tiny_llama_dir, num_prompts=8, max_new_tokens=16, layers=data_layers(2), batch_size=8, device="cpu")


def test_stage_computes_on_the_resolved_device_and_records_it(tiny_llama_dir, tmp_path, capsys):
    build = BuildDir(tmp_path / "build")
    resolve.run(build, str(tiny_llama_dir))
    out = commands.run(build, "medusa", device="auto", steps=2, **TINY)
    expected = describe(resolve_device("auto"))  # the CPU here; a GPU where torch sees one
    assert build.record("spec")["device"] == expected
    assert f"specdeploy spec: computing on {expected}" in capsys.readouterr().err
    assert "device" not in build.record("spec")["settings"] and "time_budget_s" not in build.record("spec")["settings"]
    assert (out / "module.safetensors").is_file()


def test_preflight_refuses_before_any_model_is_loaded(tiny_llama_dir, data, monkeypatch, tmp_path):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the memory preflight refused")

    monkeypatch.setattr(checkpoints, "load_causal_lm", no_loading)
    monkeypatch.setattr(train_mod, "load_offline_base", no_loading)
    monkeypatch.setenv("SPECDEPLOY_MEMORY_BUDGET_GIB", "0.00001")  # ~10 KiB
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "empty_cache"))  # nothing distilled yet
    with pytest.raises(SpecDeployError) as refused:
        distill(tiny_llama_dir, num_prompts=8, max_new_tokens=16, layers=data_layers(2), batch_size=8, device="cpu")
    assert "self-distillation needs" in str(refused.value) and "GiB free" in str(refused.value)
    assert "--distill-batch" in refused.value.hint and "device_map auto" in refused.value.hint
    assert "fewer samples" in refused.value.hint
    with pytest.raises(SpecDeployError) as refused:  # data already there: the training plan is checked
        fit(tiny_llama_dir, TrainSettings(kind="eagle", steps=2, **TINY), data=data, device="cpu")
    assert "eagle training needs" in str(refused.value)
    assert "--batch-size" in refused.value.hint and "torchrun" in refused.value.hint


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(tiny_llama_dir, data):
    parallel = Parallel(rank=0, world=3, device=torch.device("cpu"))
    with pytest.raises(SpecDeployError, match="does not split over 3 processes"):
        fit(tiny_llama_dir, TrainSettings(kind="eagle", steps=2, **TINY), data=data, parallel=parallel)


def test_alone_the_same_data_parallel_code_runs_with_world_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    parallel = setup(torch.device("cpu"))
    assert (parallel.rank, parallel.world, parallel.is_main) == (0, 1, True)
    batch = torch.arange(8)
    assert torch.equal(parallel.split(batch), batch) and parallel.mine([1, 2, 3]) == [1, 2, 3]
    halves = [Parallel(rank=r, world=2).split(batch) for r in (0, 1)]
    assert torch.equal(torch.cat(halves), batch)


def test_presets_by_model_size(tiny_llama_dir, monkeypatch):
    assert presets.gpu_tier(tiny_llama_dir) == "cpu"  # a small base trains the same module on a GPU
    monkeypatch.setattr(presets, "parameter_count", lambda _: 8_030_000_000)
    assert presets.gpu_tier(tiny_llama_dir) == "gpu"
    quick = presets.settings_for("eagle", "quick")
    assert (quick.steps, quick.num_prompts, quick.teacher_forced, quick.window, quick.distill_batch) == (800, 64, 768, 256, 64)
    assert quick.ttt_steps == 1 and presets.settings_for("eagle", "long").ttt_steps == 3  # chain of 1 vs deeper drafts
    gpu = presets.settings_for("eagle", "long", tier="gpu")
    assert (gpu.window, gpu.lr, gpu.draft_vocab) == (2048, 3e-4, 32000)  # ModelOpt's EAGLE-3 recipe
    assert presets.settings_for("medusa", "quick", tier="gpu", steps=5).steps == 5
    assert not hasattr(quick, "time_budget_s")  # budgets count steps
    with pytest.raises(SpecDeployError, match="unknown preset"):
        presets.settings_for("eagle", "huge")


def test_gpu_dtype_layout_runs_on_the_cpu(tiny_llama_dir, data, tmp_path, monkeypatch):
    """What a GPU trains (a bf16 frozen base, fp32 master weights, bf16 autocast), through the
    same code on the CPU: catches dtype mismatches without a GPU."""
    monkeypatch.setattr(train_mod, "frozen_dtype", lambda device: torch.bfloat16)
    monkeypatch.setattr(train_mod, "native_bf16", lambda device: True)  # a GPU autocasts to bf16
    for kind in ("eagle", "medusa"):
        fitted = fit(tiny_llama_dir, TrainSettings(kind=kind, steps=3, **TINY), data=data, device="cpu")
        module = fitted.model.eagle_module if kind == "eagle" else fitted.model.medusa_heads
        assert {p.dtype for p in module.parameters()} == {torch.float32}
        assert fitted.model.get_input_embeddings().weight.dtype == torch.bfloat16
        assert fitted.stats["steps"] == 3 and torch.isfinite(torch.tensor(fitted.stats["final_loss"]))


def test_eagle_export_without_the_decoder_layers_equals_the_whole_base(tiny_llama_dir, data, tmp_path):
    from modelopt.torch.export import export_speculative_decoding

    spec_dir = tmp_path / "spec"
    train(tiny_llama_dir, spec_dir, TrainSettings(kind="eagle", steps=2, **TINY), data=data, device="cpu")
    export_speculative_decoding(load_spec_model(tiny_llama_dir, spec_dir, device="cpu"), export_dir=str(tmp_path / "whole"))
    ours = export_draft(tiny_llama_dir, spec_dir, device="cpu")
    assert json.loads((ours / "config.json").read_text()) == json.loads((tmp_path / "whole" / "config.json").read_text())
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_acceptance_length_is_the_shared_definition():
    chat = CategoryResult(prompts=2, new_tokens=13, target_forwards=4, accepted_draft_tokens=6)
    code = CategoryResult(prompts=1, new_tokens=5, target_forwards=4, accepted_draft_tokens=0)
    assert chat.acceptance_length == acceptance_length(6, 4) == 2.5
    assert overall({"chat": chat, "code": code}) == acceptance_length(6, 8) == 1.75  # counts summed, not ratios averaged
    assert chat.as_dict()["acceptance_length"] == 2.5


WORKER = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import save_file
    from specdeploy.speculator import distill, module_state_dict
    from specdeploy.speculator.parallel import setup
    distill.SHARD = 3  # two shards: one made by each rank
    from specdeploy.speculator.train import TrainSettings, fit
    torch.set_num_threads(1)
    model_dir, out = sys.argv[1], sys.argv[2]
    parallel = setup(torch.device("cpu"))
    settings = TrainSettings(kind="eagle", steps=3, **{TINY})
    fitted = fit(model_dir, settings, parallel=parallel)  # distills too: shards split between the ranks
    save_file(module_state_dict(fitted.model, "eagle"), f"{{out}}/rank{{parallel.rank}}.safetensors")
    parallel.close()
""")


def test_torchrun_two_ranks_end_with_identical_weights(tiny_llama_dir, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(TINY=dict(TINY, num_prompts=6, distill_batch=3)))
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep a container's own
    env = {**os.environ, "PYTHONPATH": path, "SPECDEPLOY_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_ports(1)[0]), str(script), str(tiny_llama_dir), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    shards = sorted(p.name for p in (tmp_path / "cache" / "spec_data").glob("*/shard-*"))
    assert shards == ["shard-b3-00000-3", "shard-b3-00001-3"], shards  # each rank made one, in batches of 3


@pytest.mark.gpu
def test_tiny_llama_end_to_end_on_cuda(tiny_llama_dir, tmp_path, cuda_device):
    """distill -> EAGLE and Medusa training steps -> EAGLE-3 export, all on CUDA."""
    cuda_data = distill(tiny_llama_dir, num_prompts=8, max_new_tokens=16, layers=data_layers(2), batch_size=8,
                        device=cuda_device)
    assert cuda_data.num_tokens > 0
    for kind in ("eagle", "medusa"):
        settings = TrainSettings(kind=kind, steps=3, **TINY)
        fitted = fit(tiny_llama_dir, settings, data=cuda_data, device=cuda_device)
        module = fitted.model.eagle_module if kind == "eagle" else fitted.model.medusa_heads
        assert {p.device.type for p in module.parameters()} == {"cuda"}
        assert {p.dtype for p in module.parameters()} == {torch.float32}
        assert fitted.model.get_input_embeddings().weight.dtype == torch.bfloat16  # frozen_dtype on a GPU
        assert fitted.stats["steps"] == 3 and torch.isfinite(torch.tensor(fitted.stats["final_loss"]))
        out = tmp_path / kind
        train(tiny_llama_dir, out, settings, data=cuda_data, device=cuda_device)
        assert set(module_state_dict(load_spec_model(tiny_llama_dir, out, device=cuda_device), kind)) == set(
            load_file(str(out / "module.safetensors")))
    assert (tmp_path / "eagle" / "eagle3_export" / "config.json").is_file()
