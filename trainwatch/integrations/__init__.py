"""Adapters for training frameworks: ``trainwatch.integrations.lightning`` (PyTorch Lightning)
and ``trainwatch.integrations.transformers`` (Hugging Face Trainer), each a callback.

Each is imported only when used, and needs its framework installed (``pip install
trainwatch[lightning]`` / ``trainwatch[transformers]``). docs/own-trainer.md has both.
"""
