"""Benchmarks of marlin.gemm: bench_gemm (timings), sustained (clocks under load), report (plots)."""
