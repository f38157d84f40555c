"""``kubectl vgpu``: inspect vGPU allocations and simulate placements (a kubectl plugin)."""
