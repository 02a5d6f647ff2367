"""Benchmarks for tritonblas_ops. Run them from the repository root as modules
(`python -m benchmarks.bench`, `python -m benchmarks.plot`): see README.md."""
