"""Controllers beside the extender's leader: preemption for GPU room and consolidation of fragmented room."""
