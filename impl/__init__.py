"""pytest-moeperf's reference implementation of Mixture-of-Experts batch-1 decode: routing, MoE
backends (`moe/`), the FP8 LM head (`head/`), weight formats (`quant/`), the model and its
checkpoints (`model/`), MTP speculative decoding (`speculative/`), prompts and workloads (`data/`)
and the serving engine the A/B ladder runs (`serve/`). Implementations are backends chosen by name
(`backends.py`), each recording which kernels ran."""
