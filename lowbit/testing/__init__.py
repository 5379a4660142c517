"""Fixtures shared by tests and benchmarks: synthetic quantized weights, dummy checkpoints."""
