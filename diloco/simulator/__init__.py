"""`diloco simulate`: every island and the coordinator's round logic in one process."""
