"""Draft proposers for speculative decoding (docs/architecture.md §4)."""
