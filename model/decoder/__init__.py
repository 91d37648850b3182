"""The decoder: the families table, RoPE parsing, the config resolver, the layers
(attention with grouped-query K/V, SwiGLU and MoE feed-forwards, latent attention), the
transformer and its weight loading. It computes; it never builds or owns a cache
(`model.cache` does)."""
