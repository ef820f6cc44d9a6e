"""The shared Decoupled DiLoCo library: mathematics, wire format and contracts of the learner and the synchronizer."""
