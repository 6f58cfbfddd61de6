"""The coordinator process: a facade (`coordinator.py`) over parts that each decide one thing."""
