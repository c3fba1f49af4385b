"""Vision model kinds (each registers itself on import)."""

from models.vision import vit  # noqa: F401
