"""The island process: its loop (`island_worker.py`), its copy of θ, sync, presence, saves, supervisor."""
