"""The floor: what every package needs, JAX-free and gRPC-free (docs/architecture.md, "Package boundaries").

`errors.UserError` (the root of every user-facing error), `codec` (the wire format of an encoded tensor: its
spec, byte layout and decoder), `fields` (config field metadata) and `safetensors` (the file format `diloco export`
writes). Nothing here imports JAX, gRPC or another package of ours, so the wire, a config loader and `diloco --help`
can stand on it without loading either (tests/test_layering.py keeps that).
"""
