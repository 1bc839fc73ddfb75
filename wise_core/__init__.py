"""Framework-free core of wise: configs, checkpoint format, and the numpy specification of WISE."""

__version__ = "0.1.0"

from wise_core import reference
from wise_core.model_config import ModelConfig
from wise_core.presets import PRESETS
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig

__all__ = ["ModelConfig", "WiseConfig", "SpeculativeConfig", "PRESETS", "reference"]
