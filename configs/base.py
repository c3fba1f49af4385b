"""The strict base of every config section: unknown keys, coerced types and non-finite numbers
are errors, a validated config is frozen, and every field has a readable title (the Prefect UI's
form shows it above the field's description)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# words of field names spelled out or capitalised in titles; a trailing unit becomes "(unit)"
_WORDS = {
    "lr": "learning rate",
    "dp": "DP",
    "diloco": "DiLoCo",
    "hf": "Hugging Face",
    "moe": "MoE",
    "vit": "ViT",
    "mtbf": "MTBF",
    "url": "URL",
    "gpus": "GPUs",
    "id": "ID",
    "ff": "FF",
    "lm": "LM",
    "bpe": "BPE",
    "mlp": "MLP",
    "kv": "KV",
}
_UNITS = {"s": "s", "ms": "ms", "gbit": "Gbit/s", "bytes": "bytes", "mib": "MiB"}


def field_title(name: str, _info: object = None) -> str:
    """A field's title from its name: ``outer_lr`` → "Outer learning rate", ``heartbeat_timeout_s``
    → "Heartbeat timeout (s)", ``mtbf_s`` → "MTBF (s)"."""
    words = name.strip("_").split("_")
    unit = _UNITS.get(words[-1]) if len(words) > 1 else None
    if unit is not None:
        words = words[:-1]
    text = " ".join(_WORDS.get(w, w) for w in words)
    text = text[:1].upper() + text[1:]
    return f"{text} ({unit})" if unit else text


class Strict(BaseModel):
    # strict: numbers are never coerced from booleans or strings (`learners: true` is an error, not
    # 1); ints are still accepted where a float is expected. YAML files are read with
    # :class:`ConfigLoader`, so `3e-4` is a float there, as in YAML 1.2.
    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, strict=True, field_title_generator=field_title
    )


_Strict = Strict  # the name the sections use
