"""Balanced tensor fragmentation and the staggered send schedule.

Source: Decoupled DiLoCo (Douillard et al., 2026), "Fragments and schedule"; Streaming DiLoCo
(arXiv 2501.18512) for the staggered offsets.
"""

from __future__ import annotations

from collections.abc import Mapping


def balanced_fragments(tensor_bytes: Mapping[str, int], num_fragments: int) -> list[list[str]]:
    """Bin-pack whole tensors into ``num_fragments`` fragments of near-equal byte size.

    Greedy longest-processing-time: tensors sorted by size (bytes, descending; ties by name) go one
    by one into the currently smallest fragment (ties: lowest index). Deterministic: the same
    ``{name: bytes}`` mapping always gives the same partition, so every learner and the syncer
    derive it from the parameter tree alone.

    Args:
        tensor_bytes: tensor name → size in bytes.
        num_fragments: P ≥ 1.

    Returns:
        P lists of tensor names (each sorted by name); their union is every tensor, disjoint.

    Raises:
        ValueError: if P < 1 or P exceeds the number of tensors (a fragment would be empty).
    """
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be ≥ 1, got {num_fragments}")
    if num_fragments > len(tensor_bytes):
        raise ValueError(f"num_fragments (P={num_fragments}) exceeds the number of tensors ({len(tensor_bytes)})")
    order = sorted(tensor_bytes.items(), key=lambda kv: (-kv[1], kv[0]))
    bins: list[list[str]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments
    for name, size in order:
        target = min(range(num_fragments), key=lambda i: (loads[i], i))
        bins[target].append(name)
        loads[target] += size
    return [sorted(b) for b in bins]


def fragment_offsets(num_fragments: int, period: int) -> list[int]:
    """Offsets t_p = ⌊p·H/P⌋, spread evenly over [0, H) (shared when P > H)."""
    if num_fragments < 1 or period < 1:
        raise ValueError(f"need P ≥ 1 and H ≥ 1, got P={num_fragments}, H={period}")
    return [p * period // num_fragments for p in range(num_fragments)]


def fragments_due(step: int, num_fragments: int, period: int) -> list[int]:
    """Fragments a learner sends after completing local step ``step`` (1-based).

    Fragment p is due when (step − t_p) mod H = 0 and step ≥ 1, so each fragment is sent once every
    H inner steps and, with P = H, exactly one fragment is sent per step.
    """
    if step < 1:
        return []
    return [p for p, offset in enumerate(fragment_offsets(num_fragments, period)) if (step - offset) % period == 0]
