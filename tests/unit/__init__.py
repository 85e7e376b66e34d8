"""Unit tier: one piece at a time, no model forward against transformers, no service processes."""
