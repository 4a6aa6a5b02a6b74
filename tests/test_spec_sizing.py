"""The CPU recipe by measured speed (speculator/sizing.py): the larger quick EAGLE where its predicted
time fits the budget, the smaller elsewhere, cut to fit on a host too slow for that; measured once per
build and recorded; the work counted as the stage batches it; the probe runs the stage's own functions
on a real (tiny) base."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest
import torch

from specdeploy.manifest import BuildDir
from specdeploy.speculator import commands, presets, sizing
from specdeploy.speculator.train import stage_settings

pytestmark = pytest.mark.usefixtures("spec_cache")  # conftest: a private data cache, one thread

LARGE, SMALL = (presets.settings_for("eagle", "quick", tier=tier) for tier in ("cpu", "cpu-small"))
WORK = sizing.Work(prefill_tokens=20_000, read_tokens=200_000, decode_steps=400, train_steps=800)


def _build(tmp_path, base: str = "{}") -> BuildDir:
    build = BuildDir(tmp_path / "b")
    with build.stage("resolve", "base", {}) as tmp:
        (tmp / "config.json").write_text(base)
    return build


def _host(monkeypatch, train_step_s: float, calls: list | None = None) -> None:
    """A host whose training step takes `train_step_s` (the rest of the work ~0.1 s a unit)."""
    def measure(base_dir, settings, device, **_):
        if calls is not None:
            calls.append(settings)
        return sizing.HostSpeed(token_s=2e-4, decode_step_s=0.1, train_step_s=train_step_s)

    monkeypatch.setattr(sizing, "measure", measure)
    monkeypatch.setattr(sizing, "work_for", lambda settings, tokenizer: replace(
        WORK, train_steps=settings.steps, read_tokens=WORK.read_tokens * settings.teacher_forced // LARGE.teacher_forced))
    monkeypatch.setattr("specdeploy.checkpoints.load_tokenizer", lambda base_dir: None)


def test_predicted_seconds_add_the_units_of_work():
    speed = sizing.HostSpeed(token_s=1e-3, decode_step_s=0.5, train_step_s=0.25)
    assert WORK.seconds(speed) == pytest.approx(220 + 200 + 200)


def test_a_fast_cpu_trains_the_larger_quick_eagle_and_a_slow_one_the_smaller(tmp_path, monkeypatch):
    trained, calls = [], []
    monkeypatch.setattr(commands, "train", lambda base, out, settings, **_: trained.append(settings))
    _host(monkeypatch, train_step_s=0.1, calls=calls)  # 44 + 40 + 80 s: within the budget
    fast = _build(tmp_path / "fast")
    commands.run(fast, "eagle", device="cpu")
    _host(monkeypatch, train_step_s=0.5, calls=calls)  # 44 + 40 + 400 s: beyond it
    slow = _build(tmp_path / "slow")
    commands.run(slow, "eagle", device="cpu")
    assert trained == [LARGE, SMALL] and calls == [LARGE, LARGE]  # the larger recipe is what is timed
    assert fast.record("spec")["sizing"]["tier"] == "cpu" and slow.record("spec")["sizing"]["tier"] == "cpu-small"
    assert slow.record("spec")["sizing"]["predicted_s"] == pytest.approx(484, abs=0.1)
    assert slow.record("spec")["settings"] == json.loads(json.dumps(stage_settings(SMALL)))  # the manifest reproduces it


def test_a_cpu_too_slow_for_the_smaller_recipe_cuts_its_reads_and_steps_to_fit(tmp_path, monkeypatch):
    """cpu-small at 1 s a step: 44 s of its own answers (not cut) + 13.3 s of reads + 400 s of steps > 420 s;
    90% of the reads and steps fits (0.95 would not). The manifest holds the cut settings, a rerun finds
    the stage complete."""
    trained = []
    monkeypatch.setattr(commands, "train", lambda base, out, settings, **_: trained.append(settings))
    _host(monkeypatch, train_step_s=1.0)
    build = _build(tmp_path)
    commands.run(build, "eagle", device="cpu")
    fitted = replace(SMALL, steps=360, teacher_forced=230)
    assert trained == [fitted]
    record = build.record("spec")
    assert record["sizing"]["tier"] == "cpu-small" and record["sizing"]["fraction"] == 0.9
    assert record["sizing"]["chosen_predicted_s"] <= sizing.SPEC_BUDGET_S < record["sizing"]["predicted_s"]
    assert record["settings"] == json.loads(json.dumps(stage_settings(fitted)))
    monkeypatch.setattr(sizing, "measure", lambda *a, **_: pytest.fail("measured although the stage was complete"))
    assert commands.run(build, "eagle", device="cpu") == build.path("spec") and len(trained) == 1


def test_a_cut_stops_at_half_and_leaves_what_the_user_set(tmp_path, monkeypatch, capsys):
    """At 3 s a step even half of cpu-small's steps is beyond the budget: half it is, with a warning;
    --steps given by the user is kept, the reads are still cut."""
    trained = []
    monkeypatch.setattr(commands, "train", lambda base, out, settings, **_: trained.append(settings))
    _host(monkeypatch, train_step_s=3.0)
    commands.run(_build(tmp_path / "a"), "eagle", device="cpu")
    assert trained == [replace(SMALL, steps=200, teacher_forced=128)]
    assert "too slow for the budget even at 50%" in capsys.readouterr().err
    commands.run(_build(tmp_path / "b"), "eagle", device="cpu", steps=120)  # cpu-small: 44 + 13.3 + 360 s, uncut
    commands.run(_build(tmp_path / "c"), "eagle", device="cpu", steps=130)  # 44 + 13.3 + 390 s: only the reads cut
    assert trained[1:] == [replace(SMALL, steps=120), replace(SMALL, steps=130, teacher_forced=128)]


def test_the_speed_is_measured_once_per_build_and_per_base(tmp_path, monkeypatch):
    """A rerun (the module deleted, or a stage interrupted) keeps the speed first measured, and
    predicts the recipe it is asked for with it: other overrides, another tier where the time says
    so, and the record names what ran; another base in the same build folder is measured again."""
    trained, calls = [], []
    monkeypatch.setattr(commands, "train", lambda base, out, settings, **_: trained.append(settings))
    build = _build(tmp_path)
    _host(monkeypatch, train_step_s=0.5, calls=calls)
    commands.run(build, "eagle", device="cpu")
    _host(monkeypatch, train_step_s=0.1, calls=calls)  # the host is faster now (another hour): not measured again
    commands.run(build, "eagle", device="cpu", steps=401)  # 44 + 40 + 0.5 x 401 s at the recorded speed: fits
    assert trained == [SMALL, replace(LARGE, steps=401)] and len(calls) == 1
    assert build.record("spec")["sizing"]["work"]["train_steps"] == 401
    commands.run(build, "eagle", device="cpu", steps=100)
    commands.run(build, "eagle", device="cpu")  # the defaults again: 800 steps do not fit, as first predicted
    assert trained[-1] == SMALL and build.record("spec")["sizing"]["predicted_s"] == pytest.approx(484, abs=0.1)
    with build.stage("resolve", "base", {"other": "base"}) as tmp:
        (tmp / "config.json").write_text('{"another": "base"}')
    commands.run(build, "eagle", device="cpu")
    assert trained[-1] == LARGE and len(calls) == 2
    commands.run(build, "medusa", device="cpu")  # the same build, a kind with one quick recipe
    assert trained[-1].kind == "medusa" and "sizing" not in build.record("spec")


def test_a_batch_or_window_override_measures_the_speed_again(tmp_path, monkeypatch):
    """The speed is per unit of the settings it was measured with: a step of 32 windows is not a step
    of 4, so the recorded speed of the defaults predicted a --batch-size 32 recipe within the budget."""
    trained, calls = [], []
    monkeypatch.setattr(commands, "train", lambda base, out, settings, **_: trained.append(settings))
    build = _build(tmp_path)
    _host(monkeypatch, train_step_s=0.1, calls=calls)  # 44 + 40 + 80 s: fits
    commands.run(build, "eagle", device="cpu")
    _host(monkeypatch, train_step_s=0.8, calls=calls)  # a step of 8x the windows, measured: beyond the budget
    commands.run(build, "eagle", device="cpu", batch_size=LARGE.batch_size * 8)
    assert len(calls) == 2 and calls[1].batch_size == LARGE.batch_size * 8
    assert trained == [LARGE, replace(SMALL, batch_size=LARGE.batch_size * 8)]
    commands.run(build, "eagle", device="cpu", batch_size=LARGE.batch_size * 8, steps=100)  # counts only: not again
    assert len(calls) == 2


def test_no_measurement_when_both_tiers_train_the_same(tmp_path, monkeypatch):
    trained = []
    monkeypatch.setattr(commands, "train", lambda base, out, settings, **_: trained.append(settings))
    monkeypatch.setattr(sizing, "measure", lambda *a, **_: pytest.fail("measured although nothing was to choose"))
    for kind, preset in (("medusa", "quick"), ("dflash", "quick"), ("eagle", "long")):
        commands.run(_build(tmp_path / kind), kind, preset=preset, device="cpu")
    commands.run(_build(tmp_path / "overridden"), "eagle", device="cpu", steps=3, teacher_forced=16)
    assert [s.kind for s in trained] == ["medusa", "dflash", "eagle", "eagle"] and trained[-1].steps == 3


def test_a_module_trained_on_another_tier_is_kept(tmp_path, monkeypatch):
    """A build made on a GPU host or a faster CPU stays complete where this CPU would choose the other tier."""
    build = _build(tmp_path)
    with build.stage("spec", "spec", stage_settings(LARGE), consumes=("resolve",)) as tmp:
        (tmp / "module.safetensors").write_text("trained on a fast host")
    monkeypatch.setattr(commands, "train", lambda *a, **_: pytest.fail("trained again"))
    monkeypatch.setattr(sizing, "measure", lambda *a, **_: pytest.fail("measured although the stage was complete"))
    assert commands.run(build, "eagle", device="cpu") == build.path("spec")


def test_padded_positions_count_batches_longest_first():
    sequences = [[0] * n for n in (3, 9, 5, 4, 8)]
    assert sizing._padded(sequences, 2) == (9 * 2 + 5 * 2 + 3, 3)  # (9, 8), (5, 4), (3)
    assert sizing._padded([], 8) == (0, 0)


def test_the_probe_times_the_stage_functions_on_a_real_base(tiny_llama_dir):
    settings = replace(presets.settings_for("eagle", "quick", tier="cpu"), num_prompts=8, code_prompts=8, teacher_forced=16,
                       distill_batch=8, max_new_tokens=24, window=32, draft_vocab=96)
    speed = sizing.measure(tiny_llama_dir, settings, torch.device("cpu"))
    assert all(0 < v < 60 and math.isfinite(v) for v in asdict(speed).values()), speed
    from specdeploy.checkpoints import load_tokenizer

    work = sizing.work_for(settings, load_tokenizer(tiny_llama_dir))
    assert work.decode_steps == 2 * 23 and work.train_steps == settings.steps  # one chat and one code batch
    assert 0 < work.read_tokens <= 16 * settings.tf_max_tokens and 0 < work.prefill_tokens <= 16 * 192
    assert work.seconds(speed) > 0


def test_a_decode_probe_that_times_no_longer_than_one_token_still_costs_decode_steps(tiny_llama_dir, monkeypatch):
    """The decode step is the difference of two generate() timings: host noise, or answers that all
    end at EOS within the probe's steps, can make it <= 0, and the prediction then left decoding out
    (decode_step_s 0.0). A step computes one position per answer: at least that many read positions."""
    settings = replace(presets.settings_for("eagle", "quick", tier="cpu"), distill_batch=8, window=32, draft_vocab=96)
    timings = {"teacher_forced": [2.0, 2.0], "generate": [0.50, 0.49]}  # the 16 steps lost in noise
    monkeypatch.setattr(sizing, "_seconds", lambda function, *a, **k: timings[function.__name__].pop(0))
    monkeypatch.setattr(sizing, "_time_training", lambda *a: 0.25)
    speed = sizing.measure(tiny_llama_dir, settings, torch.device("cpu"))
    assert speed.decode_step_s == pytest.approx(settings.distill_batch * speed.token_s) and speed.decode_step_s > 0
