"""Model kinds and their registry: ``build_model(config.model, InputShape(...)) -> ModelSpec``.

Each kind lives in its own file and registers itself on import; import it here.
"""

from models import text, vision  # noqa: F401  (register dense_lm, moe_lm, vit, vit_moe)
from models.spec import MODELS, BatchLayout, InputShape, ModelSpec, build_model, count_params, register

__all__ = ["MODELS", "BatchLayout", "InputShape", "ModelSpec", "build_model", "count_params", "register"]
