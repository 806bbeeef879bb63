"""The run configuration: keyword-only dataclasses, validated on construction, read from TOML without Ray or torch.

One module per table of a run file (``model``, ``optim``, ``data``, ``plan``, ``elastic``, ``pipeline``,
``sharding``, ``tracking``), the run itself and the checks across tables in ``run``, reading a file (and the errors
for unknown or moved keys) in ``load``. "Worker" is the one word for a device slot, in every key and flag. The data
plane builds from these values (``flexorch.workers.model`` the decoder, ``flexorch.workers.optim`` AdamW,
``flexorch.data`` the corpus).
"""

from flexorch.config.data import CorpusConfig
from flexorch.config.elastic import ElasticSettings
from flexorch.config.errors import ConfigError
from flexorch.config.load import MOVED_KEYS, config_from_dict, load_train_config
from flexorch.config.model import MODEL_PRESETS, ModelConfig, model_config
from flexorch.config.optim import OptimConfig
from flexorch.config.pipeline import PipelineSettings
from flexorch.config.plan import PlanSettings
from flexorch.config.run import TrainConfig
from flexorch.config.sharding import ShardingSettings
from flexorch.config.tracking import TrackingSettings

__all__ = [
    "MODEL_PRESETS",
    "MOVED_KEYS",
    "ConfigError",
    "CorpusConfig",
    "ElasticSettings",
    "ModelConfig",
    "OptimConfig",
    "PipelineSettings",
    "PlanSettings",
    "ShardingSettings",
    "TrackingSettings",
    "TrainConfig",
    "config_from_dict",
    "load_train_config",
    "model_config",
]
