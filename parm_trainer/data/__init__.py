"""Data pipeline: tokenizer and megatron.core GPT datasets."""
