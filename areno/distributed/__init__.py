"""Processes and groups: torch.distributed process groups, the elastic launcher, one rank of a run, collectives."""
