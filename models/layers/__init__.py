"""Layers shared by every model family: attention with RoPE, SwiGLU MLP, pre-norm block."""
