"""DFlash proposer: a ModelOpt-trained DFlash module drafts a whole block in one forward pass.

The module (ModelOpt's DFlashModule, trained after `mtsp.convert(model, [("dflash", cfg)])`; served
as specdeploy.checkpoints.modules.dflash rebuilds it, without ModelOpt) reads the target's hidden
states at `target_layer_ids`, fused by `fc` + `hidden_norm`, and injects them as extra
keys/values into each of its layers. A round runs one non-causal forward over the
block [pending token, mask, ..., mask] at positions c..c+B-1 (c = tokens the target has consumed);
the target's own lm_head turns block rows 1..B-1 into B-1 draft tokens, a chain.

The injected keys/values depend only on the target's states, never on the block, so they are a
KV cache: each round projects only the positions consumed since the last one (what EAGLE's
module cache does), and the block itself is never cached.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from specdeploy.checkpoints.modules import base_rope_theta
from specdeploy.errors import SpecDeployError
from specdeploy.runtime.proposers.head import RestrictedHead, restricted_head
from specdeploy.runtime.sampling import sample, warp
from specdeploy.runtime.types import DraftShape, DraftTree, Proposer, TargetState, model_device

DEFAULT_BLOCK_SIZE = 4


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (1, heads, n, d) with cos/sin (1, n, d), as the module applies it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashProposer(Proposer):
    kind = "chain"
    per_request = ("head",)  # the restricted head keeps the request's own tokens

    def __init__(
        self, module: Any, embed: Any, lm_head: Any, hidden_layers: tuple[int, ...], *, block_size: int,
        mask_token_id: int, head: RestrictedHead | None = None,
    ) -> None:
        self.module, self.embed, self.lm_head = module, embed, lm_head
        self.head = head  # greedy drafts: the target's head over a restricted vocabulary (head.py)
        self.hidden_layers = hidden_layers
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        parameter = next(module.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        module._maybe_init_rotary_emb(device=self.device)
        self.reset()

    def draft_shapes(self, max_len: int) -> list[DraftShape]:
        return [DraftShape("chain", k) for k in range(1, min(max_len, self.block_size - 1) + 1)]

    def reset(self) -> None:
        self.keys: list[torch.Tensor | None] = [None] * len(self.module.layers)
        self.values: list[torch.Tensor | None] = [None] * len(self.module.layers)
        self.cached = 0  # consumed positions whose injected keys/values are cached
        self.head_seen = 0  # tokens of the request the restricted head has seen
        if self.head is not None:
            self.head.reset()

    # ------------------------------------------------------------------ the context cache
    def _extend_context(self, state: TargetState) -> int:
        """Project the positions consumed since the last round; the number consumed."""
        consumed = state.tokens.shape[1] - 1
        fresh = torch.cat([state.hidden[layer][0].to(self.device) for layer in self.hidden_layers], dim=-1)
        n_new = min(fresh.shape[0], consumed)
        if not consumed - n_new <= self.cached <= consumed:  # another request's context, or a gap before these
            self.reset()
        # positions it already projected (a failed batch draft retried row by row) are not projected twice
        n_new = min(n_new, consumed - self.cached)
        if n_new == 0:
            return consumed
        positions = torch.arange(consumed - n_new, consumed, device=self.device)
        feats = self.module.hidden_norm(self.module.fc(fresh[-n_new:].to(self.dtype)))[None]
        cos, sin = self.module.rotary_emb(feats, positions[None])
        for i, layer in enumerate(self.module.layers):
            attn = layer.self_attn
            keys = _rope(attn.k_norm(attn.k_proj(feats).view(1, n_new, -1, attn.head_dim)).transpose(1, 2), cos, sin)
            values = attn.v_proj(feats).view(1, n_new, -1, attn.head_dim).transpose(1, 2)
            self.keys[i] = keys if self.keys[i] is None else torch.cat([self.keys[i], keys], dim=2)
            self.values[i] = values if self.values[i] is None else torch.cat([self.values[i], values], dim=2)
        self.cached = consumed
        return consumed

    # ------------------------------------------------------------------ one block
    def _block(self, pending: int, start: int) -> torch.Tensor:
        """The module's output rows (B, hidden) for the block [pending, mask...] at `start`."""
        ids = torch.tensor([[pending] + [self.mask_token_id] * (self.block_size - 1)], device=self.device)
        hidden = self.embed(ids).to(self.dtype)
        positions = torch.arange(start, start + self.block_size, device=self.device)[None]
        cos, sin = self.module.rotary_emb(hidden, positions)
        size = self.block_size
        for i, layer in enumerate(self.module.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = _rope(attn.q_norm(attn.q_proj(x).view(1, size, -1, attn.head_dim)).transpose(1, 2), cos, sin)
            k = _rope(attn.k_norm(attn.k_proj(x).view(1, size, -1, attn.head_dim)).transpose(1, 2), cos, sin)
            v = attn.v_proj(x).view(1, size, -1, attn.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, torch.cat([self.keys[i], k], dim=2), torch.cat([self.values[i], v], dim=2),
                scale=attn.scaling, enable_gqa=True,
            )
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, size, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.module.norm(hidden)[0]

    def propose(self, state: TargetState, max_tokens: int) -> DraftTree:
        if max_tokens <= 0 or not all(layer in state.hidden for layer in self.hidden_layers):
            return DraftTree.empty(state.tokens.device)
        start = self._extend_context(state)
        if self.cached == 0:  # no target states to draft from
            return DraftTree.empty(state.tokens.device)
        rows = self._block(int(state.tokens[0, -1]), start)[1 : 1 + min(max_tokens, self.block_size - 1)]
        if state.params.greedy and self.head is not None:
            self.head.see(state.tokens[0, self.head_seen :].tolist())
            self.head_seen = state.tokens.shape[1]
            return DraftTree.chain(self.head.top1(rows)[0].to(state.tokens.device))
        logits = self.lm_head(rows).float()
        if state.params.greedy:
            return DraftTree.chain(logits.argmax(dim=-1).to(state.tokens.device))
        # each block row is its own distribution, given the context only: sample each from it
        probs = warp(logits, state.params)
        tokens = torch.tensor([sample(p, state.generator) for p in probs], dtype=torch.long, device=state.tokens.device)
        return DraftTree.chain(tokens, probs.to(state.tokens.device))


# ---------------------------------------------------------------------- the module


def modelopt_config(
    target_config: Any, *, mask_token_id: int, block_size: int = DEFAULT_BLOCK_SIZE, num_layers: int = 1,
    intermediate_size: int | None = None, target_layer_ids: list[int] | None = None,
) -> dict[str, Any]:
    """The dict for mtsp.convert(model, [("dflash", cfg)]), sized like the target (ModelOpt's
    defaults are Qwen3-8B's: heads, head_dim and MLP width must be given for a small base)."""
    heads = target_config.num_attention_heads
    arch = {
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(target_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        "intermediate_size": intermediate_size or target_config.intermediate_size,
        "rms_norm_eps": getattr(target_config, "rms_norm_eps", 1e-6),
        # the draft attends over the target's injected K/V, so it needs the target's RoPE base, and
        # ModelOpt's export writes that base; ModelOpt 0.47 copies it only from a config attribute,
        # which transformers 5 no longer has (rope_parameters): without this it trains at 10000
        "rope_theta": base_rope_theta(target_config),
    }
    if target_layer_ids is not None:
        arch["target_layer_ids"] = list(target_layer_ids)
    return {
        "dflash_block_size": block_size,
        "dflash_mask_token_id": mask_token_id,
        "dflash_use_torch_compile": False,  # CPU: compiled training steps are ~100x slower (docs/environment.md)
        "dflash_architecture_config": arch,
    }


def build(
    target: Any, *, spec_dir: str | os.PathLike | None = None, path: str | os.PathLike | None = None,
    block_size: int | None = None, mask_token_id: int | None = None, head_rows: int | None = None,
    seed: int = 0,
) -> DFlashProposer:
    """A DFlash proposer from a spec/ folder (trained; `path` is an alias), or a fresh module (tests).

    spec/ holds spec_config.json {"kind": "dflash", "modelopt_config": the dict given to
    mtsp.convert} and module.safetensors (the `dflash_module.*` tensors): the spec stage's
    contract (specdeploy/checkpoints/modules/__init__.py); `block_size` and `mask_token_id`, where
    given with one, must be the module's. A fresh module drafts `block_size` - 1 tokens (default
    DEFAULT_BLOCK_SIZE); its mask token defaults to the last id of the vocabulary.
    `head_rows`: greedy drafts take their top-1 over that many common ids plus the request's own
    tokens instead of the target's full head (head.py); None: the full head.
    """
    from specdeploy.checkpoints.modules import load_module
    from specdeploy.checkpoints.modules import read_spec_config

    spec_dir = spec_dir if spec_dir is not None else path
    if spec_dir is not None:
        spec = read_spec_config(spec_dir)
        if spec["kind"] != "dflash":
            raise SpecDeployError(f"{spec_dir} holds a {spec['kind']!r} module, not a DFlash one",
                                  hint=f"use --spec {spec['kind']}")
        config = spec["modelopt_config"]
    else:
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        if block_size < 2:
            raise SpecDeployError(f"DFlash block_size must be >= 2, got {block_size}", hint="a block is the pending token plus drafts")
        mask = target.config.vocab_size - 1 if mask_token_id is None else mask_token_id
        config = modelopt_config(target.config, mask_token_id=mask, block_size=block_size)
    mask = config.get("dflash_mask_token_id")
    if mask is None:
        raise SpecDeployError(f"{spec_dir}: the DFlash module names no dflash_mask_token_id",
                              hint="train it with the spec stage, which records the mask token")
    # refuses what the proposer does not implement; spec_dir's keys checked against the config
    module = load_module("dflash", target.config, config, spec_dir, dtype=next(target.parameters()).dtype,
                         device=model_device(target), seed=seed)
    if spec_dir is not None:  # a setting given beside a trained module is its own, or refused: it cannot change it
        for name, given, own in (("block_size", block_size, module.block_size), ("mask_token_id", mask_token_id, int(mask))):
            if given is not None and given != own:
                raise SpecDeployError(f"DFlash {name} {given} differs from the trained module's {own} ({spec_dir})",
                                      hint=f"leave {name} out: the module was trained with {own}")
    # output_hidden_states indexing: layer l's output is entry l + 1 (0 = embeddings)
    layers = tuple(layer + 1 for layer in module.config.target_layer_ids)
    return DFlashProposer(module, target.get_input_embeddings(), target.get_output_embeddings(), layers,
                          block_size=module.block_size, mask_token_id=int(mask), head=restricted_head(target, head_rows))
