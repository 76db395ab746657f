"""Data: tokenizers, the embedded default corpus, packed datasets with document boundaries, samplers."""
