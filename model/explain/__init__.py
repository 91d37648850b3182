"""Views that explain a model with its own numbers: what a model folder holds (facts),
the anatomy of a block, the attention view of one cached token, and K/V quantization
quality. They build on the runtime; the runtime never imports them."""
