"""Benchmarks: workloads, measurement and their report sections."""
