"""Elementwise and small ops: RMSNorm, rotary, SiLU-and-mul, sampling, and the decode graphs' input loader."""
