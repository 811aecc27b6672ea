"""The policy and its step: the model, its optimizer, the loss of a micro-batch, the logprobs of
sampled tokens, precision, LoRA, finite checks, and what a publish or a reset carries."""
