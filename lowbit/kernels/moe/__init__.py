"""Mixture-of-experts kernels: tokens sorted by expert, grouped GEMMs over all experts, the top-k weighted combine."""
