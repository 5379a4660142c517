"""The engine loop and its torch-free parts: requests, sequences, block manager, scheduler, outputs."""
