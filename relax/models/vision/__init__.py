"""Vision-language models: the vision towers, their projections into the language model, and
the language model's inputs for image prompts (embeddings with the image features in place,
positions, the image tokens' attention)."""
