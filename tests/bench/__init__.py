"""Tests of the benchmarks' short forms (bench/)."""
