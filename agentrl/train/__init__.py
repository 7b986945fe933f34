"""Training: the GSPO-token learner (scoring, the step, its diagnostics, weight sync), the `agentrl train`
loop and its setup, checkpoints, SFT and the run's tracking."""
