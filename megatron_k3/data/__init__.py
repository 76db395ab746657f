"""Data: tokenizers, the embedded default corpus, packed datasets with document boundaries, samplers, and
image-text documents for vision-language training (multimodal.py; docs/data.md)."""
