"""Discrete-event goodput simulator (no ML) and WAN bandwidth estimates: `diloco simulate`."""
