"""The run: its setup, the training loop, and what it leaves and shows (outputs, trackers, plot)."""
