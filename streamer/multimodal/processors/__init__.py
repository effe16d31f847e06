"""Image and video processors, one per model family (transformers' outputs, in torch)."""
