"""specdeploy: ship an LLM with speculative decoding, from a Hugging Face model to a verified
Triton model repository. One module per pipeline stage; stages talk through a build directory."""

__version__ = "0.1.0"

from specdeploy.device import tune_cpu_blas

tune_cpu_blas()  # before torch's first matrix product (MKL reads its code path once)
