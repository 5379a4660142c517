"""Helpers for tests and benchmarks: synthetic quantized weights."""
