"""Field metadata shared by every config section (each section lives beside the code that reads it)."""

from __future__ import annotations

LOCAL = {"local": True}
"""Field metadata: a per-process setting (which TLS files this process uses, an admitted island's own data), not part
of the run's identity. `diloco.config.to_dict` leaves it out, so the coordinator and each island may set their own
and still agree on the config digest, and rotating a certificate does not make a run directory "another run"."""
