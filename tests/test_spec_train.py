"""Spec stage on the tiny Llama: self-distillation, ModelOpt training lowers the loss, checkpoints
resume, the spec/ folder round-trips, and the CLI reports bad trees and low acceptance. On the CPU
explicitly (these pin the CPU numerics; tests/test_spec_device.py covers the other devices)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdeploy import cli
from specdeploy.checkpoints import load_causal_lm
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.proposers.eagle import EagleProposer
from specdeploy.runtime.types import TargetState
from specdeploy.speculator import load_spec_model, module_state_dict
from specdeploy.speculator.distill import distill
from specdeploy.speculator.train import TrainSettings, data_layers, train

TINY = dict(num_prompts=8, max_new_tokens=24, window=48, batch_size=4, draft_vocab=96, distill_batch=8, lr=3e-3)


pytestmark = pytest.mark.usefixtures("spec_cache")  # conftest: a private data cache, one thread


@pytest.fixture(scope="module")
def data(tiny_llama_dir):
    return distill(tiny_llama_dir, num_prompts=8, max_new_tokens=24, layers=data_layers(2), batch_size=8, device="cpu")


def test_distillation_data_is_cached_and_consistent(tiny_llama_dir, data):
    again = distill(tiny_llama_dir, num_prompts=8, max_new_tokens=24, layers=data_layers(2), batch_size=8, device="cpu")
    assert torch.equal(again.tokens, data.tokens)
    n = len(data.tokens)
    assert all(h.shape == (n, 64) for h in data.hidden.values())
    assert int((~data.valid).sum()) == data.info["num_samples"] == 8  # one end per sample
    # the captured states are the base's: at the answer's positions its argmax is the next token
    target = load_causal_lm(tiny_llama_dir)
    ends = (~data.valid).nonzero().squeeze(1)
    answer = torch.cat([torch.arange(e - 12, e) for e in ends.tolist()])  # answers are 24 tokens
    with torch.no_grad():
        predicted = target.lm_head(data.hidden[2][answer].float()).argmax(-1)
    assert (predicted == data.tokens[answer + 1]).float().mean() > 0.8


@pytest.mark.parametrize("kind,lr,ttt", [("eagle", 3e-3, 3), ("eagle", 3e-3, 1), ("medusa", 2e-2, 3)])
def test_training_lowers_the_loss(tiny_llama_dir, data, tmp_path, kind, lr, ttt):
    settings = TrainSettings(kind=kind, steps=15, ttt_steps=ttt, **{**TINY, "lr": lr})
    stats = train(tiny_llama_dir, tmp_path / "spec", settings, data=data, device="cpu")
    assert stats["steps"] == 15
    assert stats["final_loss"] < 0.9 * stats["first_loss"]
    config = json.loads((tmp_path / "spec" / "spec_config.json").read_text())
    assert config["kind"] == kind and config["training"]["final_loss"] == stats["final_loss"]
    prefix = "eagle_module." if kind == "eagle" else "medusa_heads."
    assert all(k.startswith(prefix) for k in load_file(str(tmp_path / "spec" / "module.safetensors")))
    if kind == "eagle":
        assert config["modelopt_config"]["eagle_offline"] is False
        assert config["modelopt_config"]["eagle_ttt_steps"] == ttt and len(stats["final_acc"]) == ttt  # one accuracy per TTT step
        exported = json.loads((tmp_path / "spec" / "eagle3_export" / "config.json").read_text())
        trained = config["modelopt_config"]["eagle_architecture_config"]["rope_scaling"]
        assert (exported.get("rope_scaling") or {}).get("rope_type", "default") == trained["rope_type"] == "default"  # not YaRN


def test_the_stage_never_resumes_a_checkpoint_of_another_base(tmp_path):
    """The model changed under the same build: its resolve output differs, so does the checkpoint
    folder, and the old base's run (possibly finished) is dropped instead of resumed."""
    from specdeploy.manifest import BuildDir
    from specdeploy.speculator.commands import _checkpoint_dir

    build = BuildDir(tmp_path / "build")
    for weights in ("first base", "second base"):
        with build.stage("resolve", "base", {"model": "/models/m"}) as tmp:
            (tmp / "model.safetensors").write_text(weights)
        if weights == "first base":
            first = _checkpoint_dir(build)
            first.mkdir(parents=True)
            (first / "state.json").write_text("{}")
            assert _checkpoint_dir(build) == first and (first / "state.json").is_file()  # the same base: kept
    second = _checkpoint_dir(build)
    assert second != first and not first.exists()


def test_resume_continues_where_it_stopped(tiny_llama_dir, data, tmp_path):
    settings = dict(kind="eagle", checkpoint_every=4, **TINY)
    first = train(tiny_llama_dir, tmp_path / "a", TrainSettings(steps=6, **settings), ckpt_dir=tmp_path / "ck", data=data,
                  stop_at=4, device="cpu")
    assert first["steps"] == 4
    resumed = train(tiny_llama_dir, tmp_path / "b", TrainSettings(steps=6, **settings), ckpt_dir=tmp_path / "ck", data=data,
                    device="cpu")
    straight = train(tiny_llama_dir, tmp_path / "c", TrainSettings(steps=6, **settings), data=data, device="cpu")
    assert resumed["steps"] == 6
    a = load_file(str(tmp_path / "b" / "module.safetensors"))
    b = load_file(str(tmp_path / "c" / "module.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4)
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-3)


def test_a_longer_run_starts_over_instead_of_resuming_a_shorter_ones_schedule(tiny_llama_dir, data, tmp_path):
    """The learning rate follows the step count: continuing a finished 4-step run to 6 steps would
    make a module no fresh 6-step run makes, under the same recorded settings."""
    settings = dict(kind="eagle", checkpoint_every=2, **TINY)
    train(tiny_llama_dir, tmp_path / "a", TrainSettings(steps=4, **settings), ckpt_dir=tmp_path / "ck", data=data, device="cpu")
    longer = train(tiny_llama_dir, tmp_path / "b", TrainSettings(steps=6, **settings), ckpt_dir=tmp_path / "ck", data=data,
                   device="cpu")
    fresh = train(tiny_llama_dir, tmp_path / "c", TrainSettings(steps=6, **settings), data=data, device="cpu")
    assert longer["steps"] == 6
    a = load_file(str(tmp_path / "b" / "module.safetensors"))
    b = load_file(str(tmp_path / "c" / "module.safetensors"))
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_a_checkpoint_of_other_data_is_not_resumed(tiny_llama_dir, data, tmp_path, capsys):
    """Data distilled in another dtype (another host's CPU flags) or from other prompts is other data
    under the same settings: its half-finished run starts over (the shards' cache key says which)."""
    from dataclasses import replace as replaced

    settings = TrainSettings(kind="eagle", checkpoint_every=2, steps=4, **TINY)
    ours = data.materialize()
    a = replaced(ours, info={**ours.info, "data_key": "made-in-bfloat16"})
    b = replaced(ours, info={**ours.info, "data_key": "made-in-float32"})
    for name, made in (("a", a), ("b", b), ("c", b)):  # a stops half-way; b starts over, stops; b again resumes
        train(tiny_llama_dir, tmp_path / name, settings, ckpt_dir=tmp_path / "ck", data=made, stop_at=2, device="cpu")
        assert ("resuming eagle training" in capsys.readouterr().out) == (name == "c"), name


def test_save_load_round_trip_gives_identical_proposals(tiny_llama_dir, data, tmp_path):
    spec_dir = tmp_path / "spec"
    train(tiny_llama_dir, spec_dir, TrainSettings(kind="eagle", steps=3, **TINY), data=data, device="cpu")
    target = load_causal_lm(tiny_llama_dir)
    loaded = load_spec_model(tiny_llama_dir, spec_dir, device="cpu")
    saved = load_file(str(spec_dir / "module.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in module_state_dict(loaded, "eagle").items())
    from_dir = build_proposer("eagle", target, spec_dir=spec_dir, mode="dynamic")
    from_model = EagleProposer(loaded.eagle_module, target.get_input_embeddings(), loaded.eagle_module.lm_head,
                               from_dir.hidden_layers, mode="dynamic")
    fresh = build_proposer("eagle", target, mode="dynamic", draft_vocab=96, seed=1)
    tokens = torch.tensor([[5, 17, 33, 90, 4, 8, 9, 11]])
    with torch.no_grad():
        out = target(tokens[:, :-1], output_hidden_states=True)
    state = TargetState(tokens=tokens, hidden={i: out.hidden_states[i] for i in from_dir.hidden_layers})
    a, b = from_dir.propose(state, 10), from_model.propose(state, 10)
    assert torch.equal(a.tokens, b.tokens) and a.parents == b.parents
    assert not torch.equal(fresh.module.fc.weight, from_dir.module.fc.weight)  # the weights really were loaded


@pytest.mark.parametrize("kind,option", [("eagle", "checkpoint_every"), ("eagle", "draft_vocab"), ("eagle", "distill_batch"),
                                         ("medusa", "medusa_layers")])
def test_counts_below_one_are_refused_before_the_distillation(kind, option):
    """They failed in the training loop (ZeroDivisionError, an empty argmax, an empty optimizer),
    after minutes of distillation."""
    from specdeploy.errors import SpecDeployError

    with pytest.raises(SpecDeployError, match=f"{option.replace('_', '-')} must be positive, got 0"):
        TrainSettings(kind=kind, **{**TINY, option: 0}).validate()


def test_a_batch_that_does_not_split_is_refused_before_distilling(tiny_llama_dir, monkeypatch):
    from specdeploy.errors import SpecDeployError
    from specdeploy.speculator import train as train_module
    from specdeploy.speculator.parallel import Parallel

    monkeypatch.setattr(train_module, "distill", lambda *a, **k: pytest.fail("distilled before refusing"))
    with pytest.raises(SpecDeployError, match="does not split over 3 processes"):
        train_module.fit(tiny_llama_dir, TrainSettings(kind="eagle", steps=2, **TINY),
                         parallel=Parallel(rank=0, world=3, device=torch.device("cpu")))


def test_cli_rejects_a_tree_deeper_than_the_heads(tmp_path, capsys, tiny_llama_dir):
    code = cli.main(["spec", "train", "--build-dir", str(tmp_path / "b"), "--model", str(tiny_llama_dir),
                     "--spec", "medusa", "--medusa-heads", "2", "--choices", "[[0], [0, 0], [0, 0, 0]]"])
    assert code == 2
    assert "depth 3 but there are only 2 heads" in capsys.readouterr().err


def test_cli_train_then_validate_with_bound(tmp_path, capsys, tiny_llama_dir):
    build = tmp_path / "build"
    args = ["spec", "train", "--build-dir", str(build), "--model", str(tiny_llama_dir), "--spec", "medusa",
            "--steps", "3", "--num-prompts", "8", "--max-new-tokens", "24", "--window", "16", "--distill-batch", "8",
            "--device", "cpu"]
    assert cli.main(args) == 0
    assert (build / "spec" / "module.safetensors").is_file()
    validate = ["spec", "validate", "--build-dir", str(build), "--prompts", "1", "--max-new-tokens", "12", "--dtype", "float32",
                "--device", "cpu"]
    assert cli.main(validate + ["--ar-lower-bound", "1.0"]) == 0
    assert '"overall_acceptance_length"' in capsys.readouterr().out
    assert cli.main(validate + ["--ar-lower-bound", "50"]) == 2
    assert "below --ar-lower-bound 50" in capsys.readouterr().err


def test_code_prompts_are_completed_raw_in_their_own_shards(tiny_llama_dir):
    from specdeploy.data import stdlib_code_digest, stdlib_code_prompts
    from specdeploy.fileio import cache_dir
    from specdeploy.checkpoints import load_tokenizer
    from specdeploy.speculator.distill import MAX_PROMPT_TOKENS

    code = distill(tiny_llama_dir, num_prompts=0, code_prompts=4, max_new_tokens=8, layers=data_layers(2), batch_size=4,
                   device="cpu")
    shards = {p.name for p in (cache_dir() / "spec_data").glob("*/code-*")}
    assert f"code-{stdlib_code_digest()}-b4-00000-4" in shards
    tokenizer = load_tokenizer(tiny_llama_dir)
    ends = [0, *((~code.valid).nonzero().squeeze(1) + 1).tolist()]
    samples = [code.tokens[a:b].tolist() for a, b in zip(ends, ends[1:])]
    for prompt in stdlib_code_prompts(4):  # raw text (no chat template), cut from the front like validate's code
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-MAX_PROMPT_TOKENS:]
        assert any(s[: len(ids)] == ids and len(s) > len(ids) for s in samples)
