"""The MoE causal LM: configuration presets, layers with softmax, KDA or MLA attention and their
decode kernels, the NEXTN (MTP) layer, transformers-format checkpoint loading and saving, and
building a model by preset name or checkpoint folder (`build_model`)."""

from impl.model.build import build_model
from impl.model.causal_lm import MoECausalLM
from impl.model.config import PRESETS, ModelConfig, get_config

__all__ = ["PRESETS", "MoECausalLM", "ModelConfig", "build_model", "get_config"]
