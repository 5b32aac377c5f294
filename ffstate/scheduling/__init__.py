"""Pacing replication into the idle windows of the training's own communication (docs/design.md section 4,
step 3). Rank side: ``marks`` (DDP's and FSDP2's collectives marked in the slot header), ``profiling`` (a few
profiled steps' timeline where nothing marks them) and ``pacing`` (which of the two a worker gives its daemon).
Daemon side: ``windows`` (the ranks' intervals merged, the next step's predicted) and ``scheduler`` (when each
chunk may go, by the link's measured rate and those windows)."""
