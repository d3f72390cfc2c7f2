"""The prompted encoder: trainable prefixes (PrefixPrompt), the frozen backbone wrapper (PromptEncoder), pooling."""
