"""Learning from the samples: rewards, group advantages and the clipped loss (grpo), the
engine/trainer corrections, the policy model (whole, or a LoRA adapter on it), the train step,
and the supervised warm-up."""
