"""Runs the model for a scheduled step: model loading, the KV cache, step inputs, CUDA graphs, sampling."""
