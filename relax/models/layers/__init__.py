"""Building blocks of a decoder layer: rotary embeddings, the matmul, LoRA parameters."""
