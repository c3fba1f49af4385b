from models.text import dense  # noqa: F401
