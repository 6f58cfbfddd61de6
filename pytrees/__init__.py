"""A JAX pytree as named tensors: leaf names, digests, the codecs' jitted encoders and error feedback.

Directly above the floor (`floor/`, whose wire format and decoder these encode for) and below `islands` and
`diloco`, which both send pytrees: the island its pseudo-gradient, the coordinator its outer update
(docs/architecture.md, "Package boundaries").
"""
