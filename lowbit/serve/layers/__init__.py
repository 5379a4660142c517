"""The layers served models are built from; the kernel fusions and their hand-offs live here."""
