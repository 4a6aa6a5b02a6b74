"""Reading checkpoints: the low layer every stage and the runtime stand on.

A base model's Hugging Face folder (hf.py), a quantize-stage checkpoint served with its own
numerics (quantized.py) and the quant_algo names both know (quant_algos.py). Nothing here imports
a stage, ModelOpt or pickle; loading for serving reads downward only, into this package.
"""

from specdeploy.checkpoints.hf import checkpoint_dtype, load_causal_lm, load_tokenizer, plain_greedy

__all__ = ["checkpoint_dtype", "load_causal_lm", "load_tokenizer", "plain_greedy"]
