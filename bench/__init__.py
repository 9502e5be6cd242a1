"""Benchmarks of dmattn_cute against other attention implementations (GPU only)."""
