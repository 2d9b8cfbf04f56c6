"""The MoE causal LM: configuration presets, layers, and building a model by name or folder."""

from impl.model.build import build_model
from impl.model.causal_lm import MoECausalLM
from impl.model.config import PRESETS, ModelConfig, get_config

__all__ = ["PRESETS", "MoECausalLM", "ModelConfig", "build_model", "get_config"]
