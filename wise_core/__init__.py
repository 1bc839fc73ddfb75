"""Framework-free core of wise: configs, checkpoint format, and the numpy specification of WISE."""

from wise_core.config import ModelConfig, WiseConfig, SpeculativeConfig, PRESETS
from wise_core import reference

__all__ = ["ModelConfig", "WiseConfig", "SpeculativeConfig", "PRESETS", "reference"]
