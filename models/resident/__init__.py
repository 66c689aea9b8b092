"""Resident services of a run (``run.resident``): the actor and critic trainers and the generation engine stay
loaded for the whole run; the iteration tasks send them requests (docs/cluster.md#running-the-resident-mode)."""
