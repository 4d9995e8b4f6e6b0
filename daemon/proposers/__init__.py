"""Draft proposers for speculative decoding (ARCHITECTURE.md section 4)."""
