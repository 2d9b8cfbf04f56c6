"""The MoE causal LM: configuration presets, layers with softmax, KDA or MLA attention and their
decode kernels, the NEXTN (MTP) layer, transformers-format checkpoint loading and saving, and
building a model by preset name or checkpoint folder (`build_model`).

The names below are loaded on first use (impl.lazy_exports), so importing config.py alone (the
presets, the embedded checkpoints, the heads) does not import torch."""

from impl.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "build": ("build_model",),
    "causal_lm": ("MoECausalLM",),
    "config": ("EMBEDDED", "HEADS", "PRESETS", "ModelConfig", "get_config"),
})
