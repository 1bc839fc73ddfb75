"""Every configuration of wise under one name, a re-export only (nothing is defined here): for
users who want one import, and for the modules that still import from here. Each lives in the
module of its job:

- `wise_core.model_config`: `ModelConfig`, a model's architecture (its `config.json`);
- `wise_core.presets`: `PRESETS`, named architectures (the released models, the test shapes);
- `wise_core.wise_config`: `WiseConfig`, the WISE decode settings, and Huginn's profile
  (`huginn_wise_config`);
- `wise_core.adaptive_depth`: `AdaptiveDepth`, Huginn's per-token exit;
- `wise_core.speculative_config`: `SpeculativeConfig`, lossless speculative decoding;
- `wise_core.config_error`: `ConfigError`, what each of them raises.
"""

from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.config_error import ConfigError
from wise_core.model_config import ModelConfig
from wise_core.presets import PRESETS
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig, huginn_wise_config

__all__ = ["AdaptiveDepth", "ConfigError", "ModelConfig", "PRESETS", "SpeculativeConfig", "WiseConfig",
           "huginn_wise_config"]
