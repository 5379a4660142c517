"""Paged attention: the KV store, decode, prefill / extend, and rotary fused into the KV store."""
