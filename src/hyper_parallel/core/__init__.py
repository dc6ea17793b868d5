"""Core features of hyper_parallel."""
