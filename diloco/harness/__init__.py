"""Processes on one machine: `diloco launch`, the process harness that tests and benchmarks drive, and
kernel-shaped links."""
