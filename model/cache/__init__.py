"""What a model remembers between tokens: the K/V caches (full, rotating, chunked,
quantized), their statistics, saved cache files and their integrity checks, the
server's prefix pool, and the K/V arithmetic (bytes per token, what fits)."""
