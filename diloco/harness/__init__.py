"""Processes on one machine: `diloco launch`, the process harness tests use, kernel-shaped links, and fault
injection at named points."""
