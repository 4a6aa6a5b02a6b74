"""DFlash proposer on the tiny Llama: greedy output equals plain greedy (a random module and one
trained a few steps with ModelOpt, whose drafts are accepted), the cached context equals the
module's own forward over the whole context, rejection sampling stays lossless, spec/ errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from specdeploy.errors import SpecDeployError
from specdeploy.runtime.decoding import generate
from specdeploy.runtime.proposers import build_proposer
from specdeploy.runtime.proposers.dflash import modelopt_config
from specdeploy.checkpoints.modules import MODULE_FILE, SPEC_CONFIG
from specdeploy.runtime.types import SamplingParams, TargetState
from tests.test_runtime_helpers import one_thread, target, tokenizer  # noqa: F401
from tests.test_runtime_sampling import chi_square_ok, tiny_counts, tiny_expected

PROMPTS = [[5, 17, 33, 90, 4, 8, 9], [100, 101, 102, 7], [3, 60, 61, 62, 63, 64, 65, 66, 67, 12, 13]]
BLOCK = 4
MASK = 383  # the tiny vocabulary's last id


def train_dflash(model_dir, target, steps: int, out_dir):
    """A DFlash module trained by ModelOpt on the target's own greedy continuations, saved as the
    spec stage saves it (spec_config.json + the dflash_module.* tensors); the training data too."""
    import modelopt.torch.speculative as mtsp

    config = modelopt_config(target.config, mask_token_id=MASK, block_size=BLOCK)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(0)
    mtsp.convert(model, [("dflash", copy.deepcopy(config))])
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(16):
        prompt = torch.randint(3, 380, (4,), generator=generator).tolist()
        answer = generate(target, prompt, SamplingParams(max_new_tokens=28)).token_ids
        rows.append((prompt + answer + [0] * 32)[:32])  # 32: a multiple of the block size
    data = torch.tensor(rows)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=data, attention_mask=torch.ones_like(data)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    tensors = {k: v.detach().float().contiguous() for k, v in model.state_dict().items() if k.startswith("dflash_module.")}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / MODULE_FILE))
    (out_dir / SPEC_CONFIG).write_text(json.dumps({"kind": "dflash", "modelopt_config": config}))
    return rows, losses


@pytest.fixture(scope="module")
def trained(tiny_llama_dir, target, tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash_spec")
    rows, losses = train_dflash(tiny_llama_dir, target, 150, out)
    return out, rows, losses


@pytest.mark.parametrize("head_rows", [None, 64], ids=["full-head", "restricted-head"])
def test_greedy_equals_plain_with_a_random_module(target, head_rows):
    proposer = build_proposer("dflash", target, block_size=BLOCK, mask_token_id=MASK, head_rows=head_rows)
    assert (proposer.head is None) == (head_rows is None)
    assert proposer.block_size == BLOCK and proposer.hidden_layers == (2,)  # ModelOpt's middle layer, +1
    params = SamplingParams(max_new_tokens=30)
    drafted = 0
    for prompt in PROMPTS:
        spec = generate(target, prompt, params, proposer, adaptive=False)
        assert spec.token_ids == generate(target, prompt, params).token_ids
        drafted += spec.metrics.draft_tokens
        assert spec.metrics.draft_tokens <= (BLOCK - 1) * spec.metrics.target_forwards
        if head_rows:  # drafts come from the common ids or the request's own tokens only
            tree = proposer.propose(TargetState(tokens=torch.tensor([prompt]), hidden=_states(target, prompt, proposer)), 3)
            assert set(tree.tokens.tolist()) <= set(range(head_rows)) | set(prompt)
    assert drafted > 0


def _states(target, prompt, proposer):
    with torch.inference_mode():
        out = target(torch.tensor([prompt[:-1]]), output_hidden_states=True)
    return {layer: out.hidden_states[layer] for layer in proposer.hidden_layers}


def test_trained_module_is_accepted_and_exact(target, trained):
    spec_dir, rows, losses = trained
    assert losses[-1] < 0.7 * losses[0]
    proposer = build_proposer("dflash", target, spec_dir=spec_dir)
    params = SamplingParams(max_new_tokens=28)
    accepted, forwards = 0, 0
    for row in rows[:4]:
        plain = generate(target, row[:4], params).token_ids
        spec = generate(target, row[:4], params, proposer, adaptive=False)
        assert spec.token_ids == plain
        accepted += spec.metrics.accepted_draft_tokens
        forwards += spec.metrics.target_forwards
    # multi-token drafts really pass verification: well above one token per target forward
    assert (accepted + forwards) / forwards > 1.5


def test_cached_context_equals_the_module_forward(target, trained):
    """The block drafted from a context fed in pieces (the per-round cache) equals ModelOpt's
    DFlashModule.forward over the whole context at once."""
    proposer = build_proposer("dflash", target, spec_dir=trained[0])
    tokens = torch.tensor([PROMPTS[2]])
    with torch.inference_mode():
        out = target(tokens[:, :-1], output_hidden_states=True)
        hidden = {layer: out.hidden_states[layer] for layer in proposer.hidden_layers}
        context = torch.cat([hidden[layer] for layer in proposer.hidden_layers], dim=-1)
        n = context.shape[1]
        block = torch.tensor([[int(tokens[0, -1])] + [MASK] * (BLOCK - 1)])
        reference = proposer.module(noise_embedding=target.get_input_embeddings()(block), target_hidden=context,
                                    position_ids=torch.arange(n + BLOCK)[None])[0]
        for cut in (n, 3, 1):  # all at once, then in two pieces, then one position first
            proposer.reset()
            proposer._extend_context(TargetState(tokens=tokens[:, : cut + 1], hidden={k: v[:, :cut] for k, v in hidden.items()}))
            if cut < n:
                proposer._extend_context(TargetState(tokens=tokens, hidden={k: v[:, cut:] for k, v in hidden.items()}))
            assert proposer.cached == n
            torch.testing.assert_close(proposer._block(int(tokens[0, -1]), n), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shifted", [False, True])
def test_rejection_sampling_is_lossless(target, tokenizer, trained, shifted):
    """Each block row is sampled from its own distribution q, attached to the chain: the output
    follows the warped target distribution. The check can tell: q attached one row off fails it."""
    prompt = tokenizer("The quick brown fox")["input_ids"]
    proposer = build_proposer("dflash", target, spec_dir=trained[0])
    if shifted:
        propose = proposer.propose

        def misaligned(state, max_tokens):
            tree = propose(state, max_tokens)
            tree.probs = tree.probs.roll(1, dims=0)
            return tree

        proposer.propose = misaligned
    counts = tiny_counts(target, prompt, proposer, 600)
    assert chi_square_ok(counts, tiny_expected(target, prompt, 3), 600) != shifted


def test_settings_given_beside_a_trained_module_are_its_own_or_refused(target, trained):
    """block_size and mask_token_id come from the module; a different one was accepted and ignored."""
    module = build_proposer("dflash", target, spec_dir=trained[0])
    same = build_proposer("dflash", target, spec_dir=trained[0], block_size=module.block_size, mask_token_id=module.mask_token_id)
    assert (same.block_size, same.mask_token_id) == (module.block_size, module.mask_token_id)
    for name, value in (("block_size", module.block_size + 4), ("mask_token_id", module.mask_token_id - 1)):
        with pytest.raises(SpecDeployError, match=f"DFlash {name} {value} differs from the trained module's") as err:
            build_proposer("dflash", target, spec_dir=trained[0], **{name: value})
        assert f"leave {name} out" in err.value.hint


def test_spec_dir_errors(target, trained, tmp_path):
    with pytest.raises(SpecDeployError, match="spec_config.json not found"):
        build_proposer("dflash", target, spec_dir=tmp_path)
    other = tmp_path / "eagle"
    other.mkdir()
    (other / SPEC_CONFIG).write_text(json.dumps({"kind": "eagle", "modelopt_config": {}}))
    (other / MODULE_FILE).write_bytes((trained[0] / MODULE_FILE).read_bytes())
    with pytest.raises(SpecDeployError, match="holds a 'eagle' module"):
        build_proposer("dflash", target, spec_dir=other)
    causal = tmp_path / "causal"
    causal.mkdir()
    config = json.loads((trained[0] / SPEC_CONFIG).read_text())
    config["modelopt_config"]["dflash_draft_attention"] = "causal"
    (causal / SPEC_CONFIG).write_text(json.dumps(config))
    (causal / MODULE_FILE).write_bytes((trained[0] / MODULE_FILE).read_bytes())
    with pytest.raises(SpecDeployError, match="does not implement dflash_draft_attention='causal'"):
        build_proposer("dflash", target, spec_dir=causal)
    with pytest.raises(SpecDeployError, match="block_size must be >= 2"):
        build_proposer("dflash", target, block_size=1)
