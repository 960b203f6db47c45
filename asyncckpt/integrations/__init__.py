"""Glue for frameworks built on PyTorch: Hugging Face `transformers` (hf) and verl (verl).

Each module imports its framework only inside the functions that need it, so importing
asyncckpt never pulls in transformers or verl.
"""
