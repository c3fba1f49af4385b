from models.text import dense, moe  # noqa: F401
