"""Mixture-of-experts kernels: tokens sorted by expert, grouped GEMMs over all experts (or per-pair GEMVs at decode
sizes), the top-k weighted combine."""
