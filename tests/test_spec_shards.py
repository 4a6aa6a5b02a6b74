"""Self-distillation data streamed to shards on disk: read back exactly, training from the shards
equals training from the same data in memory, and the cache is keyed on the model's content."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from specdeploy.speculator import distill as distill_mod
from specdeploy.speculator.distill import Job, _remove_orphans, _temp_shard, cache_key, distill
from specdeploy.speculator.shards import ShardedData, within_sample
from specdeploy.speculator.train import TrainSettings, data_layers, train
from tests.tiny import make_llama

TINY = dict(num_prompts=9, teacher_forced=6, max_new_tokens=16, window=48, batch_size=4, draft_vocab=96, distill_batch=4)


@pytest.fixture(scope="module", autouse=True)
def spec_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECDEPLOY_CACHE", str(tmp_path_factory.mktemp("spec_cache")))
    mp.setattr(distill_mod, "SHARD", 4)  # several shards from a few prompts: windows cross shard boundaries
    mp.setattr(distill_mod, "TF_SHARD", 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


@pytest.fixture(scope="module")
def sharded(tiny_llama_dir) -> ShardedData:
    return distill(tiny_llama_dir, num_prompts=9, max_new_tokens=16, layers=data_layers(2), batch_size=4,
                   teacher_forced_samples=6, device="cpu")


def test_shards_read_back_exactly(sharded):
    assert sharded.info["shards"] == 5  # 9 prompts in shards of 4, 6 conversations in shards of 4
    memory = sharded.materialize()
    n = len(sharded.tokens)
    boundary = int(sharded.starts[1])
    assert 0 < boundary < n
    for layer, rows in sharded.hidden.items():
        assert rows.shape == memory.hidden[layer].shape == (n, 64)
        assert torch.equal(rows[boundary - 5:boundary + 7], memory.hidden[layer][boundary - 5:boundary + 7])  # across shards
        index = torch.tensor([[n - 1, 0, boundary, boundary], [3, boundary - 1, 7, 2]])  # unordered, repeated
        assert torch.equal(rows[index], memory.hidden[layer][index])
    assert int((~sharded.valid).sum()) == sharded.info["num_samples"] == 15


@pytest.mark.parametrize("kind,lr", [("eagle", 3e-3), ("medusa", 2e-2)])
def test_training_from_shards_equals_training_from_memory(tiny_llama_dir, sharded, tmp_path, kind, lr):
    settings = dict(kind=kind, steps=4, **{**TINY, "lr": lr})
    from_disk = train(tiny_llama_dir, tmp_path / "disk", TrainSettings(**settings), data=sharded, device="cpu")
    from_ram = train(tiny_llama_dir, tmp_path / "ram", TrainSettings(**settings), data=sharded.materialize(), device="cpu")
    a = load_file(str(tmp_path / "disk" / "module.safetensors"))
    b = load_file(str(tmp_path / "ram" / "module.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert from_disk["final_loss"] == from_ram["final_loss"]
    initial = train(tiny_llama_dir, tmp_path / "none", TrainSettings(**{**settings, "lr": 1e-12}), data=sharded, device="cpu")
    c = load_file(str(tmp_path / "none" / "module.safetensors"))
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())  # the steps did change the module
    assert initial["steps"] == 4


def test_cache_key_follows_the_weights_not_the_folder(tiny_llama_dir, tmp_path):
    settings = {"max_new_tokens": 16, "layers": [1, 2]}
    other = tmp_path / "other"  # same architecture and file sizes, other weights
    make_llama(other, AutoTokenizer.from_pretrained(tiny_llama_dir), seed=7)
    assert (other / "model.safetensors").stat().st_size == (tiny_llama_dir / "model.safetensors").stat().st_size
    assert cache_key(other, settings) != cache_key(tiny_llama_dir, settings)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_dir, copy)
    assert cache_key(copy, settings) == cache_key(tiny_llama_dir, settings)
    assert cache_key(copy, {**settings, "max_new_tokens": 17}) != cache_key(tiny_llama_dir, settings)
    (copy / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert cache_key(copy, settings) != cache_key(tiny_llama_dir, settings)  # answers to other prompt encodings


def test_answers_generated_in_batches_of_another_size_are_other_data(tiny_llama_dir, tmp_path, monkeypatch):
    """A batch's left padding rounds the states apart: answers generated 2 prompts at a time are not
    reused for a run that distills 1 at a time (as after lowering --distill-batch on an out-of-memory
    stop); a batch past the shard's size is the shard's, and the conversations read (in batches of
    their own) are reused."""
    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    made = {size: distill(tiny_llama_dir, num_prompts=2, max_new_tokens=8, layers=[1], batch_size=size, device="cpu",
                          teacher_forced_samples=2, tf_max_tokens=32).info["data_key"] for size in (2, 1, 64, 128)}
    assert made[2] != made[1] and made[64] == made[128] not in (made[1], made[2])
    shards = sorted(p.name for p in (tmp_path / "cache" / "spec_data").glob("*/*-00000-2"))
    assert len(shards) == 4 and shards[:2] == ["shard-b1-00000-2", "shard-b2-00000-2"] and shards[3] == "tf-shard-00000-2"


def test_temp_shards_of_killed_runs_are_removed_and_a_running_ones_kept(tmp_path):
    folder = tmp_path / "gen-00000-4"
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)
    dead, running = (_temp_shard(folder, pid) for pid in (gone, os.getpid()))
    elsewhere = tmp_path / f".{folder.name}.another-host-{gone}.partial"  # a cache shared with another host
    for tmp in (dead, running, elsewhere):
        (tmp / "x").parent.mkdir()
        (tmp / "x").write_bytes(b"half a shard")
    _remove_orphans([Job(folder, "generate", [], 4)])
    assert not dead.exists() and running.exists() and elsewhere.exists()


def test_ranks_list_the_missing_shards_before_any_is_made(tiny_llama_dir, tmp_path, monkeypatch):
    """Under torchrun each rank makes every world-th missing shard. A rank that listed the missing
    shards after another rank had published one would split a shorter list and a shard would go
    unmade (seen as FileNotFoundError in a two-rank run): the first barrier comes before any shard."""
    from specdeploy.speculator.parallel import Parallel

    events = []

    class TwoRanks(Parallel):
        def barrier(self) -> None:
            events.append("barrier")

    monkeypatch.setenv("SPECDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(distill_mod, "_make", lambda model_dir, jobs, **kwargs: events.append(f"make {len(jobs)}"))
    with pytest.raises(FileNotFoundError):  # no shard was really made, so reading them back fails after the barriers
        distill(tiny_llama_dir, num_prompts=8, max_new_tokens=16, layers=data_layers(2), batch_size=4, device="cpu",
                parallel=TwoRanks(rank=0, world=2))
    assert events[0] == "barrier" and events[1].startswith("make") and events[2] == "barrier", events


def test_a_loss_term_reads_only_positions_of_its_own_sample():
    """Two samples packed in one window: 0-3 and 4-6 (valid is False at each sample's last position)."""
    valid = torch.tensor([[True, True, True, False, True, True, False]])
    # EAGLE with one TTT step: the base at i and the draft at i - 1
    assert within_sample(valid, 1, itself=True).tolist() == [[False, True, True, False, False, True, False]]
    # DFlash with blocks of 2: the labels i whose two predecessors lie in i's sample; each sample's end is a label
    assert within_sample(valid, 2, itself=False).tolist() == [[False, False, True, True, False, False, True]]


def test_a_training_row_holds_one_sample_right_padded():
    """A window packing several samples let the draft at a later one attend to the earlier one
    (ModelOpt's causal mask spans the row), which serving never shows it: each row is one sample,
    or `window` positions inside a longer one, right-padded with attention 0 and no valid position."""
    from specdeploy.speculator.parallel import Parallel
    from specdeploy.speculator.shards import DistillData
    from specdeploy.speculator.train import _batch, _fixed

    lengths = [5, 12, 3, 7]  # sample 1 is longer than the window of 8
    valid = torch.cat([torch.tensor([True] * (n - 1) + [False]) for n in lengths])
    sample = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    data = DistillData(tokens=sample + 100, valid=valid, hidden={2: sample[:, None].float().expand(-1, 4).clone()}, info={})
    settings = TrainSettings(kind="eagle", window=8, batch_size=64, num_prompts=1)
    gen = torch.Generator().manual_seed(0)
    batch = _batch(data, settings, gen, _fixed(data, settings, {}, 2, torch.device("cpu")), Parallel())
    seen = set()
    for tokens, valid_row, attention, hidden in zip(batch["tokens"], batch["valid"], batch["attention"], batch["hidden"][2]):
        real = int(attention.sum())
        assert attention.tolist() == [1] * real + [0] * (8 - real) and not valid_row[real:].any()
        owners = set((tokens[:real] - 100).tolist())
        assert len(owners) == 1 and hidden[:real, 0].eq(owners.pop()).all() and hidden[real:].eq(0).all()
        sample_id = int(tokens[0]) - 100
        seen.add(sample_id)
        assert real == min(lengths[sample_id], 8)
    assert seen == {0, 1, 2, 3}
