"""The Decoupled DiLoCo learner: a PyTorch training loop that syncs fragments with the synchronizer."""
